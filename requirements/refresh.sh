#!/usr/bin/env bash
# Re-resolve requirements/lock.txt: the exact versions of everything `.[test]`, `.[serve]` and
# `.[xgrammar]` need, for the platforms and Python versions in pyproject.toml's [tool.uv]
# environments (Linux x86-64, CPython 3.11 and 3.12), one version of each package across them.
# Needs uv (`python3 -m pip install uv`). Extra arguments go to uv, e.g. `-P jax` to move
# one package, `--upgrade` to move them all.
set -euo pipefail
cd "$(dirname "$0")/.."
exec uv pip compile pyproject.toml --extra test --extra serve --extra xgrammar --universal \
  --fork-strategy fewest --quiet \
  --custom-compile-command "bash requirements/refresh.sh" -o requirements/lock.txt "$@"
