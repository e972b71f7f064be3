"""``scripts/check_tpu_lowering.py`` on the tiny models: every program of the engines'
tables exported for TPU with the Pallas backend's TPU kernels (Mosaic calls in the
programs that run them), and a program that does not lower named, with the exit status 1.

The stock tiny Nemotron-H (4 Mamba2 heads in 2 groups) is such a case today: the Mosaic
Mamba2 update needs a head tile that is a multiple of 8 (or all heads) and divides a group's
heads, and its dispatch has no XLA fallback, so its decode programs do not lower; the
same model with 16 heads (8 a group) lowers them. The split decode programs of batches with
grammar rows are in the table (the script attaches a tokenizer)."""

from __future__ import annotations

import re

import pytest

STOCK, WIDE = "nemotron_h", "nemotron_h:mamba_num_heads=16"
MAMBA2_TILE = "block_heads=4 must divide the 2 heads per group on TPU"


@pytest.fixture
def lowering(load_script):
    return load_script("check_tpu_lowering")


def _keys(lowering, name: str, spec: bool) -> tuple:
    """The program keys of the tiny engine the script builds for ``name``."""
    return lowering.tpu_runner(name, spec, "pallas", "tpu_v5e").program_keys


def test_every_program_lowers_for_tpu_or_is_named(lowering, capsys):
    assert lowering.main(["--models", f"qwen3_next,{STOCK},{WIDE}"]) == 1
    out = capsys.readouterr().out
    pattern = r"^(\S+): (\d+) lowered \((\d+) with Mosaic kernels\), (\d+) failed"
    counts = {m[0]: tuple(int(n) for n in m[1:]) for m in re.findall(pattern, out, re.M)}
    qwen, stock, wide = (
        _keys(lowering, name, name == "qwen3_next") for name in ("qwen3_next", STOCK, WIDE)
    )
    # the programs that run the Mamba2 update (a grammar batch's finish takes its forward's
    # outputs, so it fails with it)
    decodes = [key for key in stock if key.kind in ("decode", "forward", "finish")]
    assert counts["qwen3_next"][::2] == (len(qwen), 0) and counts["qwen3_next"][1] > 0
    assert counts[WIDE][::2] == (len(wide), 0) and counts[WIDE][1] > 0
    assert counts[STOCK] == (len(stock) - len(decodes), 0, len(decodes)) and decodes
    failed = re.findall(r"^NOT LOWERED (.*?copy=\d): (.*)$", out, re.M)
    want = [lowering.program_name(STOCK, key) for key in decodes]
    assert sorted(name for name, _ in failed) == sorted(want)
    assert all(MAMBA2_TILE in error for _, error in failed)
    assert {key.kind for key in qwen} >= {"extend", "decode", "forward", "finish"}
    lowered = len(qwen) + len(stock) + len(wide) - len(decodes)
    assert f"\n{lowered} programs lowered for TPU (" in out
