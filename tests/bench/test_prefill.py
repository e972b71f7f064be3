"""The FLOP count of lazyspec.bench.prefill against a hand count."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from lazyspec.bench.floor import BREAKDOWN_ORDER
from lazyspec.bench.prefill import prefill_flops


def _config(tied: bool):
    moe = SimpleNamespace(num_experts=8, top_k=2)
    return SimpleNamespace(
        arch=SimpleNamespace(moe=moe),
        tie_word_embeddings=tied,
        vocab_size=100,
        hidden_size=16,
        num_attention_heads=4,
        head_dim=8,
        attention_layer_ids=(1,),
        recurrent_layer_ids=(0, 2),
        ssm_heads=2,
        ssm_dim_a=4,
        ssm_dim_b=8,
    )


@pytest.mark.parametrize("tied", [False, True])
def test_prefill_flops_counts_each_product_once(tied):
    leaf = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)  # noqa: E731
    params = {
        "embed_tokens": leaf(100, 16),  # a gather: no FLOPs
        "layers": {"proj": leaf(16, 32), "norm": leaf(16), "experts_up": leaf(8, 16, 24)},
        "mtp": {"proj": leaf(16, 16)},  # the draft head: not the target's prefill
    }
    if not tied:
        params["lm_head"] = leaf(16, 100)
    tokens = 10
    got = prefill_flops(params, _config(tied), tokens)
    # proj every token, experts at 2 of 8, the head for the last token only
    head = 2 * 16 * 100
    assert got.weights == 2 * tokens * 16 * 32 + 2 * tokens * 8 * 16 * 24 * 2 / 8 + head
    assert got.attention == 1 * 4 * 4 * 8 * tokens * (tokens + 1) / 2  # causal pairs
    assert got.recurrent == 2 * 4 * 2 * 4 * 8 * tokens
    assert got.total == got.weights + got.attention + got.recurrent


def test_prefill_rows_with_a_profile_print_the_device_time_by_category(
    tmp_path, monkeypatch, load_script
):
    import lazyspec.bench.prefill as prefill

    bench = load_script("bench_engine")
    monkeypatch.setattr(prefill, "matmul_peak", lambda: 1e12)  # 8192-cubed is minutes on CPU
    out = tmp_path / "table.md"
    bench.main(
        ["--preset", "tiny", "--backends", "xla", "--prefill-lens", "128", "--prefill-chunk",
         "64", "--profile", str(tmp_path / "profile"), "--out", str(out)]
    )  # fmt: skip
    lines = out.read_text().splitlines()
    row = next(line for line in lines if line.startswith("| tiny | xla | 128 | 64 |"))
    assert float(row.split("|")[5]) > 0  # engine seconds
    header = lines.index("Prefill of 128 tokens in chunks of 64: device ms by category")
    names = [c.strip() for c in lines[header + 1].strip("|").split("|")]
    values = [float(c) for c in lines[header + 3].strip("|").split("|")]
    by_category = dict(zip(names, values))
    # the categories' own order, whatever order the ops ran in: rows read column for column
    assert names[-1] == "all" and names[:-1] == sorted(names[:-1], key=BREAKDOWN_ORDER.index)
    assert by_category["all"] > 0 and by_category.get("attention", 0) > 0
    assert by_category.get("recurrent", 0) > 0  # the tiny Qwen3-Next's GDN layers
    assert (tmp_path / "profile" / "prefill-xla-128-64" / "ops.json").exists()
