"""Tensor parallelism over fake CPU devices: tp = 1 and 4 serve token-identical greedy output
(Qwen3-Next and Qwen3.5 with speculation, Nemotron-H, Granite 4.0-H; extra_buffer_lazy and the
radix cache over a multi-turn workload) with identical cached tokens; every weight and pool
is sharded as the rule table says (on XLA and, per shard, with
the Pallas kernels in interpret mode), and a sharded array holds 1/tp of its bytes per device.
At tp = 4 every device holds two or more query, GDN and Mamba2 heads, and the families
cover both placements of the KV heads (split, replicated) and of the Mamba2 groups (split,
repeated) (``tp_worker.FAMILIES``), so another size would add no case.

Each tp runs in its own process (``tp_worker.py``): the device count is fixed when jax is
first imported, and this process already has jax with one device.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from lazyspec.engine.sharding import check_tp_size, make_mesh
from lazyspec.testing.tiny_models import tiny_model
from tests.engine import tp_worker
from tests.engine.device_runs import run_on_cpu_devices

TP_SIZES = (1, 4)
FAMILIES = tuple(tp_worker.FAMILIES)
# float32 sums in another order: measured <= 5e-7 apart. The tiny random models are
# nearly uniform, so a wrong shard moves logprobs by 2e-5 to 1e-1 and tokens seldom
LOGPROB_TOL = 1e-5


def _run_worker(tp: int) -> dict:
    return run_on_cpu_devices(["-m", "tests.engine.tp_worker", str(tp)], max(TP_SIZES), 900)


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    return {tp: _run_worker(tp) for tp in TP_SIZES}


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_and_cached_tokens_equal_across_tp(reports, family):
    base = reports[1][family]["outputs"]
    assert any(cached > 0 for _, cached in base)  # turn 2 hits the radix cache
    assert len({tuple(ids) for ids, _ in base}) == len(base)  # outputs differ per request
    for tp in TP_SIZES[1:]:
        assert reports[tp][family]["outputs"] == base, tp


@pytest.mark.parametrize("family", ("qwen3_next", "nemotron_h"))
def test_pallas_kernels_per_shard_give_the_outputs_of_tp_1(reports, family):
    """kernel_backend=pallas at tp = 4 (Qwen3-Next: KV heads split; Nemotron-H: KV heads
    replicated, Mamba2 groups split): each kernel runs on its device's shard and the tokens
    and cached tokens are tp = 1's, the logprobs too up to float32 summation order (the
    tiny random models' greedy tokens barely depend on some blocks: a missing psum may move
    the logprobs and no token)."""
    base = reports[1]["pallas"][family]
    assert base["kernels_mesh_size"] == 0  # tp = 1 calls the kernels on whole arrays
    assert any(out[1] > 0 for out in base["outputs"])  # turn 2 hits the radix cache
    for tp in TP_SIZES[1:]:
        got = reports[tp]["pallas"][family]
        assert got["kernels_mesh_size"] == tp
        assert [out[:2] for out in got["outputs"]] == [out[:2] for out in base["outputs"]], tp
        for out, want in zip(got["outputs"], base["outputs"]):
            assert len(out[2]) == len(want[2]) > 0
            np.testing.assert_allclose(out[2], want[2], rtol=0, atol=LOGPROB_TOL)


def test_state_updates_per_shard_write_the_pool_in_place_as_whole(reports):
    """Decode mode (the pool aliased and written, as a decode step without speculation
    does) per shard equals the whole-array call, outputs and pool, for both mixers; so does
    the state copy (its checkpoint), both pools; and the routed experts in the kernel's
    pieces of tokens (past its token limit), within float32 sums in another order."""
    for tp in TP_SIZES[1:]:
        diffs = reports[tp]["decode_update_diffs"]
        assert set(diffs) == {"gdn", "mamba2", "state_copy", "moe_pieces"}, tp
        assert diffs["moe_pieces"] <= 1e-5, (tp, diffs)
        assert max(v for k, v in diffs.items() if k != "moe_pieces") <= 1e-6, (tp, diffs)


def test_kernels_per_shard_lower_to_triton(reports):
    """For CUDA, each per-shard kernel lowers to one Triton call per device program, paged
    attention to two (its launch and the combine's); over replicated KV pools (2 KV heads
    at tp = 4) to two per KV head (the branches of the device's switch)."""
    want = {"mamba2_state_update": 1, "state_scatter": 1, "state_copy": 1}
    assert reports[4]["triton_calls"] == {
        **want,
        "paged_attention": 2,
        "paged_attention_replicated": 2 * 2,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_every_weight_and_pool_sharded_by_the_rule_table(reports, family):
    for tp in TP_SIZES:
        assert reports[tp][family]["sharding_errors"] == [], tp


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_arrays_hold_one_tp_th_per_device(reports, family):
    for tp in TP_SIZES:
        report = reports[tp][family]
        if tp == 1:
            assert report["num_sharded"] == 0
            continue
        assert report["num_sharded"] > 0
        assert report["device_bytes"] * tp == report["total_bytes"], tp
        plan = report["memory_plan"]
        assert plan["tp_size"] == tp
        single = reports[1][family]["memory_plan"]
        assert plan["weight_bytes_per_device"] < single["weight_bytes_per_device"]
        assert plan["state_bytes_per_device"] * tp == single["state_bytes_per_device"]
        # KV by KV heads; every device holds them all once tp exceeds them
        kv_shards = tp if tp <= _hf(family)["num_key_value_heads"] else 1
        assert plan["kv_bytes_per_device"] * kv_shards == single["kv_bytes_per_device"], tp


def _hf(family: str) -> dict:
    """The Hugging Face config of ``family``'s tensor-parallel model."""
    return tp_worker.FAMILIES[family][0]


# attention, GDN key, Nemotron-H's and Granite 4.0-H's Mamba2 heads
HEAD_COUNTS = ("num_attention_heads", "linear_num_key_heads", "mamba_num_heads", "mamba_n_heads")


def test_the_tp_4_models_cover_every_placement():
    """What the module's docstring claims of tp = 4's models: per device, two or more heads
    of each kind; KV heads split in one family and replicated in another; Mamba2 groups
    split in one and repeated in another."""
    tp = TP_SIZES[-1]
    hf = {family: _hf(family) for family in FAMILIES}
    heads = [
        count
        for config in hf.values()
        for name in HEAD_COUNTS
        if (count := config.get(name)) is not None
    ]
    assert len(heads) == 8 and all(count % tp == 0 and count >= 2 * tp for count in heads)
    kv = {config["num_key_value_heads"] for config in hf.values()}
    assert any(n % tp == 0 for n in kv) and any(n < tp for n in kv), kv
    groups = {hf["nemotron_h"]["n_groups"], hf["granitemoehybrid"]["mamba_n_groups"]}
    assert any(n % tp == 0 for n in groups) and any(n < tp for n in groups), groups


def test_tp_sizes_that_do_not_divide_are_named():
    cfg = tiny_model("qwen3_next").config  # 4 attention heads, 2 KV heads, 2 GDN key heads
    with pytest.raises(ValueError, match="tp_size=3 does not divide the 4 attention heads"):
        check_tp_size(cfg, 3)
    with pytest.raises(ValueError, match="tp_size=4 does not divide the 2 GDN key heads"):
        check_tp_size(cfg, 4)
    check_tp_size(cfg, 2)
    with pytest.raises(ValueError, match="tp_size=2 needs 2 devices, but only 1"):
        make_mesh(2)


# Weights every family keeps whole on each device: norms, MoE routers, the shared-expert
# gate and the MTP head's input projection (all small, or on the replicated residual width).
REPLICATED_LEAVES = re.compile(r"norm|\['gate'\]$|\['shared_expert_gate'\]|\['mtp'\]\['fc'\]")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_other_weight_has_an_axis_the_rule_table_splits(family):
    """A plan leaf without logical axes would be replicated silently (the walk of the
    workers compares shards with the plan's own axes): each weight outside the replicated
    kinds names an axis the rule table maps to the tp mesh axis."""
    import jax

    from lazyspec.engine.sharding import RULES, TP_AXIS
    from lazyspec.models.plan import leaf_axes

    model = tiny_model(family)
    plan = model.family.weight_plan(model.config, model.params)
    split = {name for name, mesh_axis in RULES if mesh_axis == TP_AXIS}
    paths = jax.tree.leaves_with_path(model.params)
    whole = sorted(
        {
            re.sub(r"\[\d+\]", "[i]", jax.tree_util.keystr(path))
            for (path, _), axes in zip(paths, jax.tree.leaves(leaf_axes(plan)))
            if not split.intersection(tuple(axes))
        }
    )
    assert whole, family  # the norms at least
    assert [name for name in whole if not REPLICATED_LEAVES.search(name)] == [], whole


def test_checkpoints_load_straight_into_shards(reports):
    for tp in TP_SIZES:
        assert reports[tp]["loading"] == {"per_expert": [], "fused": [], "dummy": []}, tp


@pytest.mark.parametrize("fused", [False, True])
def test_a_block_reads_only_its_slice_of_the_file(tmp_path, monkeypatch, fused):
    """``load(index)`` equals the whole param's block, and reads no whole tensor where the
    layout allows slicing the file (everything but the conv weights' leading-axis case)."""
    import jax
    import numpy as np

    from lazyspec.models.loader import SafetensorsReader
    from lazyspec.models.plan import _is_leaf
    from lazyspec.models.qwen3_next import param_plan
    from lazyspec.models.registry import load_model_config
    from tests.models.tiny_qwen import config_dict, write_checkpoint

    write_checkpoint(tmp_path, config_dict("moe"), seed=3, fused_experts=fused)
    reader = SafetensorsReader(tmp_path)
    leaves = jax.tree.leaves(param_plan(load_model_config(tmp_path), False), is_leaf=_is_leaf)
    wholes = [leaf.load(reader, np.float32) for leaf in leaves]
    monkeypatch.setattr(reader, "get", lambda *a, **k: pytest.fail(f"whole read of {a[0]}"))
    for leaf, whole in zip(leaves, wholes):
        index = tuple(slice(size // 2, size) for size in whole.shape)
        np.testing.assert_array_equal(leaf.load(reader, np.float32, index), whole[index])
