"""The decode step without speculation (D = 1) updates the state pools in place: each row's
working slot gets its new state from the recurrent layers directly (no per-position
scratch), a row crossing a multiple of the track interval copies its working slot into its
planned checkpoint slot, and padding rows write nothing. Checked on one hand-built step
(both kernel backends, GDN and Mamba2) against a decode from gathered rows, and on the
step's program (no per-position state, no copy of the ssm pool)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.engine import steps
from lazyspec.engine.engine import Engine
from lazyspec.engine.steps import decode_step
from lazyspec.kernels.backend import XLA_KERNELS, Kernels
from lazyspec.kernels.common import pallas_compiler_params
from lazyspec.kernels.gdn.update import gdn_state_update_pallas
from lazyspec.kernels.state.conv import ConvOptions, conv_update_pallas
from lazyspec.kernels.state.scatter import PoolBlocks, state_copy_pallas
from lazyspec.kernels.state.update_common import UpdateTiles
from lazyspec.models.interface import ForwardInputs, StateRows
from lazyspec.scheduler.batch import build_decode
from lazyspec.testing.tiny_models import small_engine, tiny_model

pytestmark = pytest.mark.pallas

INTERVAL = 16
# (request row, working slot, checkpoint slot, tokens before the step): row 1 crosses the
# boundary at 16 in this step, row 2 does not
REAL_ROWS = [(1, 3, 5, INTERVAL - 1), (2, 4, 6, INTERVAL + 4)]
# a padding row naming a real row's working slot and a real checkpoint slot, reading (by
# the clamp of its request row) a request row that crosses: it must write neither
PADDING_WORKING, PADDING_TRACK = 3, 8


def _engine(family: str, backend: str) -> Engine:
    return small_engine(
        tiny_model(family),
        "auto",
        kernel_backend=backend,
        mamba_track_interval=INTERVAL,
        max_total_tokens=1024,
        context_length=128,
    )


def _step_inputs(engine: Engine, rng):
    """Random pools (slot 0 zeros), the rows' lengths and tables, and a batch of the real
    rows then padding rows (one of them aimed at real slots, see ``PADDING_*``)."""
    layout, pools = engine.layout, engine.runner.pools

    def random_states(pool):
        values = rng.standard_normal(pool.shape).astype(np.float32) * 0.1
        values[:, 0] = 0.0
        return jnp.asarray(values, pool.dtype)

    max_reqs = layout.max_running
    seq_len = np.zeros(pools.seq_len.shape, np.int32)
    for row, _, _, pre in REAL_ROWS:
        seq_len[row] = pre
    seq_len[max_reqs] = INTERVAL - 1  # what a padding row's clamped request row reads
    table = np.zeros(pools.req_to_token.shape, np.int32)
    for row in range(1, max_reqs + 1):
        table[row] = layout.page_size + (row - 1) * table.shape[1] + np.arange(table.shape[1])
    tokens = rng.integers(3, 100, size=pools.last_token.shape).astype(np.int32)
    pools = dataclasses.replace(
        pools,
        conv=random_states(pools.conv),
        ssm=random_states(pools.ssm),
        seq_len=jnp.asarray(seq_len),
        req_to_token=jnp.asarray(table),
        last_token=jnp.asarray(tokens),
    )
    batch = build_decode(layout, [], num_rows=4)
    for b, (row, working, track, _) in enumerate(REAL_ROWS):
        batch.req_row[b], batch.working_slot[b], batch.track_slot[b] = row, working, track
    batch.working_slot[3], batch.track_slot[3] = PADDING_WORKING, PADDING_TRACK
    return pools, batch


def _decode_from_rows(engine: Engine, pools, batch):
    """The real rows' new (conv, ssm) ``[L, B, ...]``: the model's decode from the rows
    gathered out of the pools (the cache-free form of the state update)."""
    rows = np.asarray([row for row, *_ in REAL_ROWS])
    slots = np.asarray([working for _, working, *_ in REAL_ROWS])
    pre = np.asarray(pools.seq_len)[rows]
    table = np.asarray(pools.req_to_token)[rows]
    inputs = ForwardInputs(
        tokens=jnp.asarray(np.asarray(pools.last_token)[rows][:, None]),
        positions=jnp.asarray(pre[:, None]),
        num_new=jnp.ones(len(rows), jnp.int32),
        kv_write_idx=jnp.asarray(table[np.arange(len(rows)), pre][:, None]),
        kv_read_idx=jnp.asarray(table),
        ctx_len=jnp.asarray(pre + 1),
    )
    rec = StateRows(conv=pools.conv[:, slots], ssm=pools.ssm[:, slots])
    runner = engine.runner
    _, _, out = runner.family.forward(
        runner.params, runner.cfg, inputs, pools.kv, rec, mode="decode"
    )
    return np.asarray(out.final.conv), np.asarray(out.final.ssm)


def _run_step(engine: Engine, pools, batch):
    runner = engine.runner
    step = jax.jit(decode_step, static_argnums=(0, 1, 2))
    return step(runner.family, runner.cfg, runner.static, runner.params, pools, batch)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_decode_step_writes_in_place_and_copies_crossings_pallas(family, backend):
    """Working slots hold the decode's new state; the crossing row's checkpoint slot equals
    its working slot exactly, the other row's checkpoint slot is untouched; the padding
    row (aimed at a real working slot and a real checkpoint slot) writes nothing; slot 0
    stays zeros and every other slot is bit-identical."""
    engine = _engine(family, backend)
    pools, batch = _step_inputs(engine, np.random.default_rng(3))
    want_conv, want_ssm = _decode_from_rows(engine, pools, batch)
    old = {"conv": np.asarray(pools.conv), "ssm": np.asarray(pools.ssm)}
    outputs, new_pools = _run_step(engine, pools, batch)
    np.testing.assert_array_equal(np.asarray(outputs["crossed"]), [True, False, False, False])
    (_, crossing_working, crossing_track, _), (_, plain_working, plain_track, _) = REAL_ROWS
    written = [crossing_working, plain_working, crossing_track]
    for name, want in (("conv", want_conv), ("ssm", want_ssm)):
        new = np.asarray(getattr(new_pools, name))
        np.testing.assert_allclose(new[:, [crossing_working, plain_working]], want, atol=1e-5)
        assert not np.allclose(new[:, plain_working], old[name][:, plain_working])
        np.testing.assert_array_equal(new[:, crossing_track], new[:, crossing_working])
        np.testing.assert_array_equal(new[:, plain_track], old[name][:, plain_track])
        np.testing.assert_array_equal(new[:, PADDING_TRACK], old[name][:, PADDING_TRACK])
        assert not np.any(new[:, 0])
        others = np.setdiff1d(np.arange(new.shape[1]), written)
        np.testing.assert_array_equal(new[:, others], old[name][:, others])


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


def _program_args(backend: str):
    engine = _engine("qwen3_next", backend)
    runner = engine.runner
    pools, batch = _step_inputs(engine, np.random.default_rng(4))
    args = (runner.family, runner.cfg, runner.static, runner.params, pools, batch)
    step_states = (batch.req_row.shape[0], 1) + pools.ssm.shape[2:]
    return args, _shape_text(pools.ssm.shape), _shape_text(step_states)


def test_xla_decode_step_copies_no_ssm_pool():
    """Compiled with the pools donated (as the runner does), the XLA step updates the ssm
    pool where it lies: no copy of an ``[L, S+1, H, d_a, d_b]`` array in the program."""
    args, pool_text, _ = _program_args("xla")
    step = jax.jit(decode_step, static_argnums=(0, 1, 2), donate_argnums=(4,))
    hlo = step.lower(*args).compile().as_text()
    assert pool_text in hlo
    copies = [line for line in hlo.splitlines() if " copy(" in line]
    assert copies and not [line for line in copies if pool_text in line.split(" copy(")[0]]


def _triton_kernels() -> Kernels:
    """The GDN update, the conv update and the state copy as compiled for an NVIDIA GPU
    (Triton), the other functions in their XLA forms: what the step calls on a GPU,
    lowerable on CPU."""
    options = {"compiler_params": pallas_compiler_params("gpu")}

    def conv_update(*operands, num_new=None, **conv):  # ``ConvUpdateFn``'s keywords
        return conv_update_pallas(
            *operands, num_new=num_new, options=ConvOptions(**conv), block_channels=16, **options
        )

    return dataclasses.replace(
        XLA_KERNELS,
        backend="pallas",
        platform="gpu",
        gdn_state_update=functools.partial(
            gdn_state_update_pallas, tiles=UpdateTiles(block_value=8), **options
        ),
        state_copy=functools.partial(
            state_copy_pallas, blocks=PoolBlocks(block_rows=8, block_channels=16), **options
        ),
        conv_update=conv_update,
    )


def _chain_from_argument(calls: list[str], operands: list[str]) -> None:
    """``operands[0]`` is a step argument and ``operands[i]`` a result of ``calls[i - 1]``."""
    assert operands[0].startswith("%arg"), operands[0]
    for previous, operand in zip(calls, operands[1:]):
        assert operand.startswith(previous.split(":")[0].strip() + "#"), (previous, operand)


def test_pallas_decode_step_threads_the_pool_through_aliased_kernels_pallas(monkeypatch):
    """The Pallas step has no per-position state (``[B, 1, H, d_a, d_b]``, verify's scratch)
    in its jaxpr, and lowered for an NVIDIA GPU every Triton call that writes a pool in
    place (each layer's conv update on the conv pool and state update on the ssm pool, then
    the checkpoint copy on both) takes it as the only use of the previous call's output on
    that pool, starting from the step's (donated) argument: nothing else reads a pool a
    kernel overwrites, so XLA needs no copy to honour the aliasing. (Compiled on CPU the
    kernels run interpreted, whose loops copy aliased operands.)"""
    args, pool_text, states_text = _program_args("pallas")
    jaxpr = str(jax.make_jaxpr(decode_step, static_argnums=(0, 1, 2))(*args))
    assert pool_text in jaxpr and states_text not in jaxpr
    monkeypatch.setattr(steps, "kernels_for", lambda *_, **__: _triton_kernels())

    def gpu_step(*step_args):  # a function of its own: no trace of the interpreted step reused
        return decode_step(*step_args)

    step = jax.jit(gpu_step, static_argnums=(0, 1, 2), donate_argnums=(4,))
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "xla.gpu.triton(" in line]
    num_layers = len(args[1].recurrent_layer_ids)
    assert len(calls) == 2 * num_layers + 1  # per layer the conv, then the update; the copy
    aliased_by_call = []
    for line in calls:
        operands = re.search(r"triton\(([^)]*)\)", line).group(1).split(", ")
        aliased = [operands[int(i)] for i in re.findall(r"operand_index = (\d+)", line)]
        assert aliased, line
        aliased_by_call.append(aliased)
        for value in aliased:  # one use, this call; besides it a value's text appears only
            # where it is defined, unless it is a result of a multi-result op (``%7#1``)
            uses = len(re.findall(re.escape(value) + r"(?![\w#])", text))
            assert uses == (1 if "#" in value else 2), (value, uses)
    conv_calls, update_calls, copy_call = calls[:-1:2], calls[1:-1:2], calls[-1]
    assert [len(a) for a in aliased_by_call] == [1] * (2 * num_layers) + [2]
    copy_ssm, copy_conv = aliased_by_call[-1]  # the copy aliases (ssm pool, conv pool)
    _chain_from_argument(conv_calls, [a[0] for a in aliased_by_call[:-1:2]] + [copy_conv])
    _chain_from_argument(update_calls, [a[0] for a in aliased_by_call[1:-1:2]] + [copy_ssm])
    assert all(_shape_text(args[4].conv.shape)[1:-1].replace(",", "x") in c for c in conv_calls)
    assert copy_call and states_text.replace("[", "<").replace("]", "") not in text


@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid"])
def test_padding_rows_take_row_zeros_experts(family, monkeypatch):
    """In a decode step every MoE layer routes the padding rows' tokens to row 0's experts
    (``moe.padding_follows_token_zero``), so they read no expert's weights beyond the real
    rows'; the real rows keep their own routes."""
    engine = _engine(family, "xla")
    pools, batch = _step_inputs(engine, np.random.default_rng(0))
    routes = []

    def recording_experts(x, weights, expert_ids, *stacks, xla_form):
        routes.append(np.asarray(expert_ids))
        return xla_form()

    runner = engine.runner
    kernels = dataclasses.replace(runner.static.kernels, moe_experts=recording_experts)
    monkeypatch.setattr(type(runner.static), "kernels", property(lambda _: kernels))
    decode_step(runner.family, runner.cfg, runner.static, runner.params, pools, batch)  # eager
    assert len(routes) >= 2  # the MoE layers called the kernel
    for ids in routes:
        np.testing.assert_array_equal(ids[2:], np.broadcast_to(ids[:1], ids[2:].shape))
    # the real rows are routed apart somewhere, so row 1 kept its own route
    assert any((ids[1] != ids[0]).any() for ids in routes)
