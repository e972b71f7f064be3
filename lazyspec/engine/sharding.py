"""Tensor and expert parallelism: one mesh axis, one table from logical axes to mesh axes.

Every weight leaf of a plan names the logical axis of each of its axes (``TensorSpec.axes``,
``ExpertStack.axes``); the pools name theirs here (``POOL_AXES``). ``RULES`` maps logical
axes to the mesh axis ``tp`` (or to None: replicated) and flax's logical-partitioning helper
turns the names into ``NamedSharding``s. The jitted steps run SPMD over the mesh: params
and pools are placed with these shardings, the steps constrain the pools they return to
the same ones, and XLA inserts every collective. The host scheduler is unchanged: one set
of slot, page and request-row ids for all devices.

Head-major axes shard into whole heads (the size checks in ``check_tp_size`` name the
numbers that do not divide). A few axes concatenate parts of different widths (GDN's conv
channels ``[q | k | v]``, Mamba2's ``in_proj`` columns ``[z | xBC | dt]`` and conv channels
``[x | B | C]``, Granite's fused ``[gate | up]``): they are split evenly, which is exact
(XLA reshards where the math needs another split) but not communication-free. An axis
whose size the mesh does not divide (a vocabulary of odd size, say) is replicated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

TP_AXIS = "tp"

# Logical axis -> mesh axis. Names absent here (``embed``, ``head_dim``, ...) replicate.
RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", TP_AXIS),  # embedding rows, lm_head columns
    ("embed", None),  # the residual stream is replicated
    ("q_heads", TP_AXIS),  # q_proj columns, o_proj rows (head-major)
    ("kv_heads", TP_AXIS),  # k/v_proj columns and the KV pools (replicated when tp > heads)
    ("mlp", TP_AXIS),  # dense MLP and shared-expert intermediate width
    ("mlp_fused", TP_AXIS),  # fused [gate | up] columns (mixed layout)
    ("experts", TP_AXIS),  # routed experts: expert parallel over the tp axis
    ("linear_k_heads", TP_AXIS),  # GDN fused in_proj_qkvz / _ba columns, grouped per key head
    ("linear_v_heads", TP_AXIS),  # GDN z / b / a, dt_bias, A_log, out_proj rows
    ("linear_conv", TP_AXIS),  # GDN conv channels [q | k | v] (mixed layout)
    ("mamba_heads", TP_AXIS),  # Mamba2 dt_bias, A_log, D
    ("mamba_inner", TP_AXIS),  # Mamba2 gated-norm weight, out_proj rows (head-major)
    ("mamba_proj", TP_AXIS),  # Mamba2 in_proj columns [z | xBC | dt] (mixed layout)
    ("mamba_conv", TP_AXIS),  # Mamba2 conv channels [x | B | C] (mixed layout)
    ("state_channels", TP_AXIS),  # conv slot pool channels, as the conv weights
    ("state_heads", TP_AXIS),  # ssm slot pool heads
)

KV_POOL_AXES = (None, "kv_heads", None)  # [num_kv_rows, n_kv_heads, head_dim]
CONV_POOL_AXES = (None, None, "state_channels", None)  # [L_rec, slots, conv_dim, K-1]
SSM_POOL_AXES = (None, None, "state_heads", None, None)  # [L_rec, slots, H, d_a, d_b]


def _head_counts(cfg: Any) -> dict[str, int]:
    """The head-like counts a tp size must divide, by name, for the layers ``cfg`` has."""
    counts = {"attention heads": cfg.num_attention_heads}
    arch = cfg.arch
    gdn = getattr(arch, "gdn", None)
    if gdn is not None and cfg.recurrent_layer_ids:
        counts["GDN key heads"] = gdn.num_k_heads
        counts["GDN value heads"] = gdn.num_v_heads
    mamba = getattr(arch, "mamba", None)
    if mamba is not None and cfg.recurrent_layer_ids:
        counts["Mamba2 heads"] = mamba.num_heads
    moe = getattr(arch, "moe", None)
    if moe is not None:
        counts["experts"] = moe.num_experts
    return counts


def check_tp_size(cfg: Any, tp_size: int) -> None:
    """ValueError naming the numbers unless ``tp_size`` divides every head count, the
    expert count and (or is a multiple of) the KV head count."""
    for name, count in _head_counts(cfg).items():
        if count % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the {count} {name}")
    kv = cfg.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"tp_size={tp_size} neither divides nor is a multiple of the {kv} KV heads"
        )


def make_mesh(tp_size: int, nnodes: int = 1) -> Mesh:
    """A one-axis ``tp`` mesh: the first ``tp_size`` devices, or with ``nnodes`` processes
    (``jax.distributed``) the first ``tp_size // nnodes`` devices of each process, in process
    order (ValueError naming the numbers if too few)."""
    devices = jax.devices()
    if nnodes == 1:
        if tp_size > len(devices):
            raise ValueError(
                f"tp_size={tp_size} needs {tp_size} devices, but only {len(devices)} "
                f"{jax.default_backend()} devices are visible"
            )
        return Mesh(np.asarray(devices[:tp_size]), (TP_AXIS,))
    if jax.process_count() != nnodes:
        raise ValueError(f"nnodes={nnodes}, but jax runs {jax.process_count()} processes")
    per_node = tp_size // nnodes
    chosen = []
    for process in range(nnodes):
        local = [d for d in devices if d.process_index == process]
        if per_node > len(local):
            raise ValueError(
                f"tp_size={tp_size} over nnodes={nnodes} needs {per_node} devices per "
                f"process, but process {process} has {len(local)}"
            )
        chosen += local[:per_node]
    return Mesh(np.asarray(chosen), (TP_AXIS,))


@dataclass(frozen=True)
class ShardingPlan:
    """The mesh and the rule table in force; hashes by value, so jit takes it as static."""

    mesh: Mesh
    rules: tuple[tuple[str, str | None], ...]

    @property
    def tp_size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    @property
    def platform(self) -> str:
        """The mesh's devices' platform ("cpu", "gpu", "tpu")."""
        return self.mesh.devices.flat[0].platform

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def sharding(self, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
        """The ``NamedSharding`` of an array of ``shape`` whose axes are named ``axes``
        (empty: replicated); a dimension the mesh axis does not divide is replicated."""
        import flax.linen as nn

        if not axes:
            return self.replicated
        assert len(axes) == len(shape), (axes, shape)
        spec = nn.logical_to_mesh_axes(tuple(axes), self.rules)
        dims = [
            mesh_axis if mesh_axis is None or size % self.mesh.shape[mesh_axis] == 0 else None
            for mesh_axis, size in zip(spec, shape)
        ]
        return NamedSharding(self.mesh, PartitionSpec(*dims))

    def param_shardings(self, plan: Any, params: Any) -> Any:
        """Shardings of ``params`` from the ``axes`` of the plan they were built from."""
        from lazyspec.models.plan import leaf_axes

        return jax.tree.map(lambda a, p: self.sharding(a, p.shape), leaf_axes(plan), params)

    def pool_shardings(self, pools: Any) -> Any:
        """Shardings of a ``Pools`` (arrays, tracers or ``ShapeDtypeStruct`` leaves): KV by
        KV heads, conv / ssm slot pools by channels / heads, per-request rows replicated."""
        return type(pools)(
            kv=self._kv_shardings(pools.kv),
            mtp_kv=self._kv_shardings(pools.mtp_kv),
            conv=self.sharding(CONV_POOL_AXES, pools.conv.shape),
            ssm=self.sharding(SSM_POOL_AXES, pools.ssm.shape),
            seq_len=self.replicated,
            last_token=self.replicated,
            drafts=self.replicated,
            req_to_token=self.replicated,
            output_counts=self.replicated,
            in_prompt=self.replicated,
            vocab_mask=self.replicated,
        )

    def _kv_shardings(self, kv: Any) -> Any:
        if kv is None:
            return None
        per = [self.sharding(KV_POOL_AXES, pool.shape) for pool in kv.k]
        return type(kv)(k=per, v=list(per))


def sharding_plan(cfg: Any, tp_size: int, nnodes: int = 1) -> ShardingPlan:
    """The mesh over ``tp_size`` devices (of ``nnodes`` processes) and the rules for ``cfg``.
    When tp_size exceeds the KV heads, the KV projections and pools are replicated whole:
    every device holds all KV heads (SGLang gives each device one copied head, tp / KV-heads
    times less KV memory)."""
    check_tp_size(cfg, tp_size)
    rules = RULES
    if tp_size > cfg.num_kv_heads:
        logger.info(
            "tp_size=%d > %d KV heads: KV projections and pools are replicated",
            tp_size,
            cfg.num_kv_heads,
        )
        rules = tuple((name, None if name == "kv_heads" else axis) for name, axis in rules)
    return ShardingPlan(make_mesh(tp_size, nnodes), rules)


def device_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays held on one device (the first of each array's shards)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard_shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard_shape)) * leaf.dtype.itemsize
    return total
