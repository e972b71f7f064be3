"""Sparse mixture of experts with a gated shared expert (Qwen3-Next), as pure functions.

Params: ``gate`` ``[E, hidden]`` (the router, as checkpoints store it), ``experts``
``{"gate_proj": [E, hidden, I], "up_proj": [E, hidden, I], "down_proj": [E, I, hidden]}``,
``shared_expert`` (a SwiGLU MLP) and ``shared_expert_gate`` (linear hidden -> 1). Tokens are
dispatched by sorting the (token, expert) pairs by expert and running grouped matmuls
(``lax.ragged_dot``), so the cost grows with top_k, not with the number of experts; given a
``moe_experts`` kernel (``Kernels.moe_experts``), the routed experts run there instead where
it fits the shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.kernels.backend import MoEExpertsFn
from lazyspec.kernels.moe.grouping import TOKEN_ROWS_MAX_TOKENS
from lazyspec.kernels.moe.plan import SharedExpert
from lazyspec.kernels.moe.routing import TokenRouting
from lazyspec.models.layers.linear import linear
from lazyspec.models.layers.mlp import mlp_plan, swiglu_mlp
from lazyspec.models.plan import Params, TensorSpec, linear_spec


@dataclass(frozen=True)
class MoESpec:
    """Static facts of one sparse MoE block."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool


@dataclass(frozen=True)
class ExpertStack:
    """Plan leaf: one projection of every expert, stacked to ``[E, in, out]``.

    ``down_proj`` maps ``intermediate_size`` -> ``hidden_size``, any other projection the
    reverse. Reads either per-expert tensors ``{prefix}.{e}.{proj}.weight`` (the layout of
    released checkpoints and of transformers' ``save_pretrained``) or fused ``[E, out, in]``
    tensors: ``{prefix}.{proj}``, except that with ``fused_gate_up`` (Qwen3-Next) gate and
    up share ``{prefix}.gate_up_proj [E, 2I, hidden]``, gate first. ``fused_name`` names
    the fused tensor where a checkpoint calls it otherwise (Granite:
    ``block_sparse_moe.input_linear.weight``). ``dtype`` as in ``TensorSpec``; random init
    is normal with ``init_plan``'s scale.
    """

    prefix: str  # e.g. "model.layers.0.mlp.experts"
    proj: str  # "gate_proj" | "up_proj" | "down_proj"
    num_experts: int
    hidden_size: int
    intermediate_size: int
    fused_gate_up: bool = True
    dtype: str | None = None
    fused_name: str | None = None

    @property
    def axes(self) -> tuple[str | None, ...]:
        """Logical axes of ``[E, in, out]``: sharded by expert (expert parallel)."""
        return ("experts", None, None)

    def _expert_shape(self) -> tuple[int, int]:
        """Per-expert checkpoint shape ``[out, in]``."""
        h, i = self.hidden_size, self.intermediate_size
        return (h, i) if self.proj == "down_proj" else (i, h)

    def _fused_name(self) -> str:
        if self.fused_name is not None:
            return self.fused_name
        if self.fused_gate_up and self.proj != "down_proj":
            return f"{self.prefix}.gate_up_proj"
        return f"{self.prefix}.{self.proj}"

    @property
    def param_shape(self) -> tuple[int, int, int]:
        out, inp = self._expert_shape()
        return (self.num_experts, inp, out)

    def _load_fused(self, reader, dtype, experts: slice) -> np.ndarray:
        out, inp = self._expert_shape()
        shared = self.fused_gate_up and self.proj != "down_proj"
        rows = 2 * out if shared else out
        fused = TensorSpec(self._fused_name(), (self.num_experts, rows, inp))
        array = fused.load(reader, dtype, (experts, slice(None), slice(None)))
        if shared:
            array = array[:, :out] if self.proj == "gate_proj" else array[:, out:]
        return np.ascontiguousarray(np.swapaxes(array, 1, 2))

    def load(self, reader, dtype, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """``[E, in, out]`` from whichever layout the checkpoint has; ``index`` (slices of
        those axes): only that block, reading only the experts it holds."""
        index = (slice(None),) * 3 if index is None else tuple(index)
        experts, rest = index[0], (slice(None), *index[1:])
        if f"{self.prefix}.0.{self.proj}.weight" not in reader:
            if self._fused_name() in reader:
                return self._load_fused(reader, dtype, experts)[rest]
        per_expert = [
            TensorSpec(f"{self.prefix}.{e}.{self.proj}.weight", self._expert_shape(), True)
            for e in range(self.num_experts)[experts]
        ]
        return np.stack([s.load(reader, dtype, index[1:]) for s in per_expert])

    def random(
        self, rng: np.random.Generator, scale: float, index: tuple[slice, ...] | None = None
    ) -> np.ndarray:
        shape = self.param_shape
        if index is not None:
            shape = tuple(len(range(*s.indices(size))) for s, size in zip(index, shape))
        return (scale * rng.standard_normal(shape)).astype(np.float32)


def moe_plan(prefix: str, spec: MoESpec) -> Params:
    """Checkpoint plan of one sparse MoE block under ``prefix`` (e.g. ``model.layers.0.mlp``)."""
    h, e = spec.hidden_size, spec.num_experts
    experts = {
        proj: ExpertStack(f"{prefix}.experts", proj, e, h, spec.intermediate_size)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    return {
        # [E, hidden] as stored: a few tokens' logits read whole rows (``residual_norm``)
        "gate": TensorSpec(f"{prefix}.gate.weight", (e, h)),
        "experts": experts,
        "shared_expert": mlp_plan(f"{prefix}.shared_expert", h, spec.shared_intermediate_size),
        "shared_expert_gate": linear_spec(f"{prefix}.shared_expert_gate", h, 1),  # replicated
    }


def router_logits(params: Params, x: jax.Array) -> jax.Array:
    """The router's float32 logits ``[N, E]`` of x ``[N, hidden]`` (``gate`` ``[E, hidden]``)."""
    return jnp.matmul(x.astype(jnp.float32), params["gate"].astype(jnp.float32).T)


def route(
    params: Params, spec: MoESpec, x: jax.Array, logits: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Softmax router then top-k: (weights ``[N, k]`` float32, expert ids ``[N, k]``), from
    ``logits`` where given (``router_logits``).

    With ``norm_topk_prob`` the weights are the top-k probabilities over their sum, which is
    the softmax of the top-k logits (the full softmax's normaliser cancels, and softmax keeps
    the order): computed so, the step skips the softmax over every expert (two kernels per
    layer on a GPU)."""
    if logits is None:
        logits = router_logits(params, x)
    if spec.norm_topk_prob:
        top_logits, expert_ids = jax.lax.top_k(logits, spec.top_k)
        return jax.nn.softmax(top_logits, axis=-1), expert_ids
    probs = jax.nn.softmax(logits, axis=-1)
    return jax.lax.top_k(probs, spec.top_k)


def grouped_experts(
    x: jax.Array, weights: jax.Array, expert_ids: jax.Array, num_experts: int, expert_fn
) -> jax.Array:
    """``sum_j weights[n, j] * expert_{ids[n, j]}(x[n])`` for x ``[N, d]``, weights and ids
    ``[N, k]``: the (token, expert) pairs are sorted by expert and ``expert_fn(xs,
    group_sizes)`` runs every expert on its contiguous group (``lax.ragged_dot``), so the
    cost grows with k, not with the number of experts. Returns float32 ``[N, d_out]``."""
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // top_k
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    ys = expert_fn(x[token_of], group_sizes).astype(jnp.float32)
    ys = ys * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((x.shape[0], ys.shape[1]), jnp.float32).at[token_of].add(ys)


# Up to this many tokens a MoE layer routes its padding tokens like token 0
# (``padding_follows_token_zero``). More tokens touch most experts anyway (16 tokens of top-10
# over 64 experts: 93 % of them on average), and their programs stay as they were.
REROUTE_PADDING_MAX_TOKENS = 8


def padding_follows_token_zero(expert_ids: jax.Array, real: jax.Array | None) -> jax.Array:
    """``expert_ids`` ``[N, k]`` with each padding token's (``real`` false) replaced by token
    0's, for N up to ``REROUTE_PADDING_MAX_TOKENS``. A padding token's output is discarded;
    routed like token 0 it reads no expert's weights beyond the real tokens' (a one-request
    decode step runs a padding row: ``layout.MIN_DECODE_TOKENS``). ``real`` None: every
    token is real."""
    if real is None or expert_ids.shape[0] > REROUTE_PADDING_MAX_TOKENS:
        return expert_ids
    return jnp.where(real[:, None], expert_ids, expert_ids[:1])


@jax.named_scope("moe")
def routed_experts(
    params: Params,
    spec: MoESpec,
    x: jax.Array,
    moe_experts: MoEExpertsFn | None = None,
    real: jax.Array | None = None,
    shared: SharedExpert | None = None,
    shared_gate: jax.Array | None = None,
    logits: jax.Array | None = None,
    dtype: Any = None,
) -> jax.Array:
    """Sum over each token's top-k experts of weight * SwiGLU_e(x); x ``[N, hidden]``, params
    ``gate`` and ``experts`` as in the module docstring. ``moe_experts``: the kernel that
    may run the experts instead of ``grouped_experts`` (it chooses by shape). ``real``
    ``[N]``: which tokens are not padding (``padding_follows_token_zero``). ``shared``: a
    shared expert ``moe_experts`` runs with the routed ones (``fuses_shared``), its
    weighted output in the sum. A ``moe_experts`` that ``routes_tokens`` is handed the
    router's logits too, to route a few tokens in its own kernel (``TokenRouting``; with
    ``shared_gate [hidden]``, the gate whose sigmoid gave ``shared.weight``, the kernel
    computes that weight itself); the top-k below then runs only where it does not.
    ``logits``: the router's logits of x where the caller computed them
    (``Kernels.residual_norm``), else computed here. Returns x's shape, in ``dtype``
    (None: x's; float32 keeps the kernel's sums as they are)."""
    if logits is None:
        logits = router_logits(params, x)
    weights, expert_ids = route(params, spec, x, logits)
    expert_ids = padding_follows_token_zero(expert_ids, real)
    experts = params["experts"]

    def swiglu_experts(xs, group_sizes):
        xs = xs.astype(experts["gate_proj"].dtype)
        gate = jax.lax.ragged_dot(xs, experts["gate_proj"], group_sizes)
        up = jax.lax.ragged_dot(xs, experts["up_proj"], group_sizes)
        return jax.lax.ragged_dot(jax.nn.silu(gate) * up, experts["down_proj"], group_sizes)

    def xla_form():
        out = grouped_experts(x, weights, expert_ids, spec.num_experts, swiglu_experts)
        if shared is not None:
            mlp = {"gate_proj": {"weight": shared.gate}, "up_proj": {"weight": shared.up}}
            mlp["down_proj"] = {"weight": shared.down}
            out = out + shared.weight[:, None] * swiglu_mlp(mlp, x).astype(jnp.float32)
        return out

    if moe_experts is None:
        out = xla_form()
    else:
        stacks = (experts["up_proj"], experts["down_proj"], experts["gate_proj"])
        fused = {} if shared is None else {"shared": shared}
        if getattr(moe_experts, "routes_tokens", False):
            fused["routing"] = TokenRouting(
                logits, spec.top_k, spec.norm_topk_prob, real, shared_gate
            )
        out = moe_experts(x, weights, expert_ids, *stacks, xla_form=xla_form, **fused)
    return out.astype(x.dtype if dtype is None else dtype)


# Up to this many tokens the shared expert runs in the routed-experts kernel's launches
# (``fused_shared_expert``). Measured on an H200 (BENCHMARKS, "K decode steps per program,
# and the shared expert in the routed-experts kernel"): at one token 16 kernels and 29-43 us
# fewer a step; at 16 tokens the one run with it read a loop of 2.11 ms a step against
# 1.76-1.81 without, and at 64 the span moved either way: larger counts keep their MLP.
FUSE_SHARED_MAX_TOKENS = TOKEN_ROWS_MAX_TOKENS


def fused_shared_expert(
    params: Params, moe_experts: MoEExpertsFn | None, gate_weight: jax.Array
) -> SharedExpert | None:
    """The block's shared expert as a ``SharedExpert`` scaled by ``gate_weight`` ``[N]``,
    where ``moe_experts`` runs one with the routed experts (its ``fuses_shared``), N is at
    most ``FUSE_SHARED_MAX_TOKENS`` and the shared expert has a routed expert's projections:
    same shapes and dtype, no bias, gate and up apart. Else None: the caller runs it as an
    MLP of its own."""
    if not getattr(moe_experts, "fuses_shared", False):
        return None
    if gate_weight.shape[0] > FUSE_SHARED_MAX_TOKENS:
        return None
    mlp, experts = params["shared_expert"], params["experts"]
    names = ("gate_proj", "up_proj", "down_proj")
    if set(mlp) != set(names) or any(set(mlp[n]) != {"weight"} for n in names):
        return None
    if any(
        mlp[n]["weight"].shape != experts[n].shape[1:] or mlp[n]["weight"].dtype != experts[n].dtype
        for n in names
    ):
        return None
    return SharedExpert(
        up=mlp["up_proj"]["weight"],
        down=mlp["down_proj"]["weight"],
        gate=mlp["gate_proj"]["weight"],
        weight=gate_weight,
    )


def sparse_moe(
    params: Params,
    spec: MoESpec,
    x: jax.Array,
    moe_experts: MoEExpertsFn | None = None,
    real: jax.Array | None = None,
    logits: jax.Array | None = None,
) -> jax.Array:
    """The MoE block: routed experts plus ``sigmoid(shared_gate(x)) * shared_expert(x)``.

    x ``[..., hidden]`` -> same shape and dtype; ``moe_experts``, ``real`` and ``logits``
    ``[N, E]`` (over the flattened tokens) as in ``routed_experts``.
    """
    flat = x.reshape(-1, x.shape[-1])
    dtype, shape = x.dtype, x.shape
    gate = params["shared_expert_gate"]
    shared_gate = jax.nn.sigmoid(linear(gate, flat).astype(jnp.float32))
    fused = fused_shared_expert(params, moe_experts, shared_gate[:, 0])
    if fused is not None:  # one pair of launches for the routed and the shared experts
        # a routing kernel computes the gate's weight itself from the gate (no bias)
        in_kernel = None if "bias" in gate else gate["weight"][:, 0]
        out = routed_experts(params, spec, flat, moe_experts, real, fused, in_kernel, logits, dtype)
        return out.reshape(shape)
    routed = routed_experts(params, spec, flat, moe_experts, real, logits=logits)
    shared = swiglu_mlp(params["shared_expert"], flat)
    out = routed.astype(jnp.float32) + shared_gate * shared.astype(jnp.float32)
    return out.astype(dtype).reshape(shape)
