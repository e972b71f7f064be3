"""``scripts/check_tpu_lowering.py`` on the tiny models (its defaults, as CI runs it): every
program of the Qwen3-Next and Nemotron-H engines' tables exported for TPU with the Pallas
backend's TPU kernels, Mosaic calls in the programs that run them, exit status 0.

The stock tiny Nemotron-H has 4 Mamba2 heads in 2 groups: its head tile (all 4 heads)
spans both groups, which the Mosaic Mamba2 update takes since each head picks its own
group's B/C row. The split decode programs of batches with grammar rows are in the table
(the script attaches a tokenizer)."""

from __future__ import annotations

import re

MODELS = ("qwen3_next", "nemotron_h")


def test_every_program_of_the_tiny_models_lowers_for_tpu(load_script, monkeypatch, capsys):
    lowering = load_script("check_tpu_lowering")
    runs = {}  # family -> (the runner's program keys, {program: Mosaic calls})
    lower_all = lowering.lower_all

    def recording(runner, family):
        done, failed = lower_all(runner, family)
        runs[family] = (runner.program_keys, done)
        return done, failed

    monkeypatch.setattr(lowering, "lower_all", recording)
    assert lowering.main([]) == 0
    out = capsys.readouterr().out
    assert "NOT LOWERED" not in out
    pattern = r"^(\S+): (\d+) lowered \((\d+) with Mosaic kernels\), (\d+) failed"
    counts = {m[0]: tuple(int(n) for n in m[1:]) for m in re.findall(pattern, out, re.M)}
    assert sorted(counts) == sorted(runs) == sorted(MODELS)
    for family, (keys, done) in runs.items():
        assert sorted(done) == sorted(lowering.program_name(family, key) for key in keys)
        assert counts[family] == (len(keys), sum(calls > 0 for calls in done.values()), 0)
    qwen_keys = runs["qwen3_next"][0]
    assert {key.kind for key in qwen_keys} >= {"extend", "decode", "forward", "finish"}
    assert any(key.tokens > 1 for key in qwen_keys if key.kind == "decode")  # verify steps
    # the programs that run the Mamba2 update call the Mosaic kernel (a grammar batch's
    # finish runs none: it takes its forward's outputs)
    keys, done = runs["nemotron_h"]
    mamba = [key for key in keys if key.kind in ("decode", "forward")]
    assert mamba and all(done[lowering.program_name("nemotron_h", key)] > 0 for key in mamba)
    total = sum(len(keys) for keys, _ in runs.values())
    assert f"\n{total} programs lowered for TPU (" in out
