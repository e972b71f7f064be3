"""The fused kernels' check (``scripts/check_kernels.py``) in its CPU smoke mode: every
check runs and passes, and a check over its tolerance fails the script."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.kernels.tuning import Tuning


def test_check_kernels_smoke_passes_every_check_pallas(tmp_path, monkeypatch, load_script):
    check = load_script("check_kernels")
    out = tmp_path / "check.md"
    assert check.main(["--smoke", "--out", str(out)]) == 0
    text = out.read_text().splitlines()
    assert text[2].startswith("code: lazyspec ")  # the tree the checks ran
    table = text[text.index("|---|---|---|") + 1 :]
    rows = [line.split("|")[1:-1] for line in table]
    names = {row[0].strip() for row in rows}
    checks = ("route_tokens", "sparse_moe", "gdn GdnConvTokens", "gdn GdnConvTokens.grouped")
    checks += ("gdn GdnConvTokens.grouped, norm",)
    forms = {f"sparse_moe, {form[0]}" for form in check.MOE_FORMS}
    assert len(forms) == 3
    assert names == {
        *checks,
        *forms,
        "conv ChannelGroups",
        "residual_norm",
        "attention_prologue",
        "attention_prologue, one product",
        "gated_norm",
        "paged_attention gate",
        "paged_attention gate, active splits",
        "paged_attention gate in place",
    }
    assert all(row[2].strip().startswith("ok") for row in rows), rows
    # a tolerance no bf16 MoE meets fails the run
    monkeypatch.setattr(check, "MOE_TOL", 0.0)
    assert check.main(["--smoke", "--checks", "moe"]) == 1
    # a residual-norm row over its tolerance (a negative one: every row is) says so, which
    # fails the run as above
    monkeypatch.setattr(check, "NORM_TOL", -1.0)
    tuning = Tuning()
    rows = check.check_residual_norm(np.random.default_rng(0), (1,), check.WIDTHS["smoke"], tuning)
    assert rows and all(row[2].startswith("over the tolerance") for row in rows), rows
    rows = check.check_attention_prologue(
        np.random.default_rng(0), ((1, 2),), check.ATTENTION_WIDTHS["smoke"], tuning
    )
    rows += check.check_gated_norm(np.random.default_rng(0), (1,), check.WIDTHS["smoke"], tuning)
    monkeypatch.setattr(check, "ATTENTION_TOL", -1.0)
    rows += check.check_gated_attention(
        np.random.default_rng(0), ((1, 1, 20),), check.ATTENTION_WIDTHS["smoke"], tuning
    )
    assert len(rows) == 6 and all(row[2].startswith("over the tolerance") for row in rows), rows


def test_check_residual_norm_leaves_sizes_over_the_launch_pallas(load_script):
    """Sizes the launch leaves to XLA's fusions (its router's tokens times experts over the
    limit) are reported as not launched, the rest checked, and the run still passes."""
    check = load_script("check_kernels")
    tuning = Tuning().with_overrides({"norm.residual_max_token_experts": 16})
    rows = check.check_residual_norm(np.random.default_rng(0), (2,), check.WIDTHS["smoke"], tuning)
    verdicts = {shape: verdict for _, shape, verdict in rows}
    # smoke widths: 8 and 12 experts; 2 tokens of 12 experts are 24 > 16
    assert verdicts["2 tokens, 12 experts"] == check.NOT_LAUNCHED
    assert verdicts["2 tokens, 8 experts"].startswith("ok: ")
    assert verdicts["2 tokens, no router"].startswith("ok: ")
    assert check.passes(list(verdicts.values()))
    assert not check.passes([*verdicts.values(), "over the tolerance: 1.00e+00"])


def test_check_kernels_runs_under_a_kernel_tuning(tmp_path, load_script):
    """``--kernel-tuning`` overrides the device's tuning for every check (a different
    ``Tuning``: nothing is patched) and the table's header records it; an unknown name is
    refused, naming it."""
    check = load_script("check_kernels")
    out = tmp_path / "check.md"
    setting = ["--kernel-tuning", "attention.active_splits=false"]
    named = ["--checks", "gated_attention"]  # the checks the setting changes
    assert check.main(["--smoke", "--out", str(out)] + named + setting) == 0
    text = out.read_text().splitlines()
    assert text[3] == "kernel tuning: attention.active_splits = False", text[:5]
    with pytest.raises(ValueError, match="attention.no_such_field"):
        check.main(["--smoke", "--kernel-tuning", "attention.no_such_field=1"])


def test_check_kernels_runs_only_the_named_checks(tmp_path, load_script):
    """``--checks`` runs the named checks only, the header says which, and an unknown name is
    refused before anything runs, naming the choices."""
    check = load_script("check_kernels")
    out = tmp_path / "check.md"
    assert check.main(["--smoke", "--out", str(out), "--checks", "gated_attention"]) == 0
    text = out.read_text().splitlines()
    assert text[3] == "checks: gated_attention", text[:5]
    table = text[text.index("|---|---|---|") + 1 :]
    names = {line.split("|")[1].strip() for line in table}
    assert names == {
        "paged_attention gate",
        "paged_attention gate, active splits",
        "paged_attention gate in place",
    }
    with pytest.raises(SystemExit):
        check.main(["--smoke", "--checks", "gated_attention,attention"])
