"""What a routed-experts call launches (``experts.moe_experts_pallas``): its keyword
options (``MoELaunch``), the checks of its shapes against the contract in ``experts``, and
the plan they resolve to (``ExpertsPlan``), which the launches and kernels read."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.kernels.common import check_tile
from lazyspec.kernels.moe.grouping import TOKEN_ROWS_MAX_TOKENS
from lazyspec.kernels.moe.routing import TokenRouting


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedExpert:
    """An expert every token runs beside its routed ones (Qwen3-Next's gated shared expert):
    ``up [d, I]``, ``down [I, d_out]``, ``gate [d, I]`` (None for relu^2 experts), the
    widths and dtype of one routed expert, and ``weight [N]`` float32, each token's scale
    of its output (the sigmoid of the shared gate)."""

    up: jax.Array
    down: jax.Array
    gate: jax.Array | None
    weight: jax.Array


@dataclasses.dataclass(frozen=True)
class MoELaunch:
    """``moe_experts_pallas``' keyword options. Tiles None are whole axes: ``block_rows``
    (rows a tile), ``block_inner`` (the up launch's intermediate columns), ``block_out``
    (the down launch's output columns), ``block_k`` (the contraction chunk of both
    launches, unless ``block_k_down`` gives the down launch's: its whole intermediate row
    may fit in one chunk where the up launch's would not). ``token_rows``: group with
    ``group_tokens`` (every tile reads x itself, zeros after its rows) rather than
    ``group_pairs`` (tiles of staged rows); None takes ``group_tokens`` up to
    ``TOKEN_ROWS_MAX_TOKENS`` tokens (and ``block_rows``). ``route_in_up``: with token rows
    and a ``TokenRouting``, the routing runs inside the up launch (every program routing
    the few tokens itself) instead of a launch of its own before it. ``down_in_up`` (token
    rows only): the up launch's programs apply their rows of the down projection too, each
    writing its partial sums of the tokens' outputs (a token's row of every used tile: rows
    of tokens routed elsewhere weigh 0), which are summed after it: no down launch and no
    intermediate (the partials grow with tokens x tiles x inner tiles). ``pair_grid``
    (with both folds): the launch's grid is (inner tile, pair), a program per token's pair
    rather than per slot (the pairs rounded up to a power of two), so fewer programs and
    partials. ``down_compiler_params``: the down launch's, else ``compiler_params``."""

    block_rows: int = 16
    block_inner: int | None = None
    block_out: int | None = None
    block_k: int | None = None
    block_k_down: int | None = None
    token_rows: bool | None = None
    route_in_up: bool = False
    down_in_up: bool = False
    pair_grid: bool = False
    interpret: bool = False
    compiler_params: Any = None
    down_compiler_params: Any = None


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """A call's launches, ``MoELaunch`` resolved against the shapes (``plan_experts``): the
    tiles checked (None axes whole), the folds that apply, the shared expert's id (E, None
    without one) and the expert count with it. The kernels read it as static values."""

    num_tokens: int
    gated: bool
    shared_expert: int | None
    num_experts: int
    inner: int
    out_width: int
    dtype: Any  # the intermediate's: the weights'
    block_rows: int
    block_inner: int
    block_out: int
    block_k: int
    block_k_down: int
    token_rows: bool
    by_logits: bool
    route_in_up: bool
    down_in_up: bool
    pair_grid: bool
    interpret: bool
    compiler_params: Any
    down_compiler_params: Any


def check_experts(
    x: jax.Array, expert_ids: jax.Array, up: jax.Array, down: jax.Array, gate: jax.Array | None
) -> None:
    """ValueError unless the shapes fit the module docstring's contract."""
    num_experts, width, inner = up.shape
    if x.ndim != 2 or x.shape[1] != width:
        raise ValueError(f"x {x.shape} must be [N, {width}] for experts {up.shape}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {expert_ids.shape} must be [{x.shape[0]}, k]")
    if down.shape[:2] != (num_experts, inner):
        raise ValueError(f"down {down.shape} must be [{num_experts}, {inner}, d_out]")
    if gate is not None and gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} must match up {up.shape}")


def check_routing(x: jax.Array, routing: TokenRouting, up, down, gate) -> None:
    """``check_experts`` for a call routed by ``routing`` (logits over the stacks' experts)."""
    num_experts = up.shape[0]
    if routing.logits.shape != (x.shape[0], num_experts):
        raise ValueError(
            f"routing logits {routing.logits.shape} must be [{x.shape[0]}, {num_experts}]"
        )
    if routing.real is not None and routing.real.shape != (x.shape[0],):
        raise ValueError(f"routing real {routing.real.shape} must be [{x.shape[0]}]")
    if routing.shared_gate is not None and routing.shared_gate.shape != x.shape[1:]:
        raise ValueError(f"routing shared_gate {routing.shared_gate.shape} must be {x.shape[1:]}")
    ids = jax.ShapeDtypeStruct((x.shape[0], routing.top_k), jnp.int32)
    check_experts(x, ids, up, down, gate)


def check_shared(shared: SharedExpert, num_tokens: int, up, down, gate) -> None:
    """ValueError unless ``shared``'s matrices are one routed expert's shapes and dtype."""
    pairs = [("up", shared.up, up), ("down", shared.down, down)]
    if (shared.gate is None) != (gate is None):
        raise ValueError("the shared expert has a gate exactly when the routed experts do")
    if gate is not None:
        pairs.append(("gate", shared.gate, gate))
    for name, matrix, stack in pairs:
        if matrix.shape != stack.shape[1:] or matrix.dtype != stack.dtype:
            raise ValueError(
                f"shared {name} {matrix.shape} {matrix.dtype} must be one routed expert's "
                f"{stack.shape[1:]} {stack.dtype}"
            )
    if shared.weight.shape != (num_tokens,):
        raise ValueError(f"shared weight {shared.weight.shape} must be [{num_tokens}]")


def plan_experts(
    x: jax.Array,
    expert_ids: jax.Array | None,
    up: jax.Array,
    down: jax.Array,
    gate: jax.Array | None,
    shared: SharedExpert | None,
    routing: TokenRouting | None,
    launch: MoELaunch,
) -> ExpertsPlan:
    """The plan of a call (``ExpertsPlan``), after checking the shapes (ValueError)."""
    num_tokens = x.shape[0]
    token_rows = launch.token_rows
    if token_rows is None:
        token_rows = num_tokens <= min(TOKEN_ROWS_MAX_TOKENS, launch.block_rows)
    by_logits = token_rows and routing is not None
    if by_logits:
        check_routing(x, routing, up, down, gate)
    else:
        check_experts(x, expert_ids, up, down, gate)
    num_experts, width, inner = up.shape
    shared_expert = None
    if shared is not None:
        check_shared(shared, num_tokens, up, down, gate)
        shared_expert = num_experts
        num_experts += 1
    out_width = down.shape[2]
    block_k_down = launch.block_k if launch.block_k_down is None else launch.block_k_down
    tiles = {
        "block_inner": check_tile("block_inner", inner, launch.block_inner),
        "block_out": check_tile("block_out", out_width, launch.block_out),
        "block_k": check_tile("block_k", width, launch.block_k),
        "block_k_down": check_tile("block_k", inner, block_k_down),
    }
    if launch.block_rows <= 0:
        raise ValueError(f"block_rows={launch.block_rows} must be positive")
    route_in_up = by_logits and launch.route_in_up
    down_in_up = token_rows and launch.down_in_up
    params = launch.compiler_params
    down_params = params if launch.down_compiler_params is None else launch.down_compiler_params
    return ExpertsPlan(
        num_tokens=num_tokens,
        gated=gate is not None,
        shared_expert=shared_expert,
        num_experts=num_experts,
        inner=inner,
        out_width=out_width,
        dtype=up.dtype,
        block_rows=launch.block_rows,
        **tiles,
        token_rows=token_rows,
        by_logits=by_logits,
        route_in_up=route_in_up,
        down_in_up=down_in_up,
        pair_grid=route_in_up and down_in_up and launch.pair_grid,
        interpret=launch.interpret,
        compiler_params=params,
        down_compiler_params=down_params,
    )
