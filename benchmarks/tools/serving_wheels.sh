#!/usr/bin/env bash
# The server's extra packages (fastapi, uvicorn, llguidance, jsonschema and everything they
# need) as CPython 3.12 manylinux wheels in .whl, for a machine with no package index: the
# device scripts install them from there (`pip install --no-index --find-links .whl ...`).
# .whl is ignored by git; the wheels are about 7 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl fastapi uvicorn llguidance jsonschema
ls .whl
