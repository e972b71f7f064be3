"""The bytes a decode step must move, and where a step's device time goes.

``step_floor_bytes`` counts what no implementation of a decode step can avoid reading or
writing from device memory: the weights the step touches (every non-expert weight, the
language-model head, the embedding rows of its tokens and, per MoE layer, the experts its
tokens are routed to), the recurrent state of every row read once and written once, and the
KV of every row's context read once. The floor of a step is those bytes over the copy
bandwidth measured in the same run; a step's "% of floor" is floor time / step time.

``device_breakdown`` splits a profiled step's device time by the named scopes the model
layers and the steps open (``attention``, ``recurrent``, ``moe``, ``mlp``, ``lm_head``,
``sampling``, ``state_commit``, ``draft_extend``), reading each executed op's scope from the
compiled program's HLO metadata; ``device_spans`` reads a profiled step's device time as it
runs (first kernel's start to last kernel's end), which holds with CUDA graphs on too.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

# Scope names opened by the layers and the steps, in the order a path is searched: the
# draft head's work is "draft" whatever it calls; else the outermost category of the path.
CATEGORIES = (
    "draft_extend",
    "attention",
    "recurrent",
    "moe",
    "mlp",
    "lm_head",
    "sampling",
    "state_commit",
)
# the categories ``category`` returns, in the order a breakdown's columns are printed
BREAKDOWN_ORDER = (*(c for c in CATEGORIES if c != "draft_extend"), "draft", "other")


def expected_routed_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected number of distinct experts ``num_tokens`` tokens touch, each routed to
    ``top_k`` of ``num_experts`` uniformly (random weights route near-uniformly):
    ``E * (1 - (1 - k / E) ** N)``."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True)
class FloorBytes:
    weights: float  # bytes of weights a step touches
    state: float  # recurrent state read + written
    kv: float  # KV read (context) + written (new tokens)

    @property
    def total(self) -> float:
        return self.weights + self.state + self.kv


def _path(keys) -> str:
    return jax.tree_util.keystr(keys)


def touched_weight_bytes(
    params: Any, num_experts: int, top_k: int, num_tokens: int, expert_rows: int | None = None
) -> float:
    """Bytes of ``params`` a forward over ``num_tokens`` tokens reads: every leaf, except
    that an expert stack (a leaf under ``experts*`` with ``expert_rows`` rows: one device's
    share of the ``num_experts``, all of them by default) counts only its expected routed
    share and the embedding table only the tokens' rows (the whole table when it is also the
    head, i.e. there is no ``lm_head``)."""
    expert_rows = num_experts if expert_rows is None else expert_rows
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [_path(keys) for keys, _ in leaves]
    tied = not any("lm_head" in p for p in paths)
    routed = expected_routed_experts(num_experts, top_k, num_tokens) if num_experts else 0.0
    total = 0.0
    for path, (_, leaf) in zip(paths, leaves):
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        stack = "['experts" in path and "shared" not in path
        if stack and num_experts and leaf.shape[0] == expert_rows:
            total += nbytes * routed / num_experts
        elif "embed_tokens" in path and not tied:
            total += min(num_tokens, leaf.shape[0]) * nbytes / leaf.shape[0]
        else:
            total += nbytes
    return total


def step_floor_bytes(
    params: Any,
    cfg: Any,
    *,
    rows: int,
    positions: int,
    mean_context: float,
    slot_bytes: int,
    kv_bytes_per_token: int,
    mtp_kv_bytes_per_token: int = 0,
    tp_size: int = 1,
) -> FloorBytes:
    """The bytes one decode step of ``rows`` requests, ``positions`` tokens each (1, or D
    with speculation), must move at ``mean_context`` tokens of context per row. With an MTP
    head (``"mtp"`` in params) its weights count once, at the step's token count, and its
    KV like the target's. Over a mesh of ``tp_size`` devices, pass one device's shapes
    (``shard_shapes``) and byte counts: the floor is then that of one device."""
    num_experts, top_k = _moe_shape(cfg)
    tokens = rows * positions
    expert_rows = num_experts // tp_size if num_experts else None
    weights = touched_weight_bytes(params, num_experts, top_k, tokens, expert_rows)
    state = 2.0 * rows * slot_bytes
    per_token = kv_bytes_per_token + mtp_kv_bytes_per_token
    kv = rows * (mean_context + positions) * per_token
    return FloorBytes(weights=weights, state=state, kv=kv)


def shard_shapes(tree: Any) -> Any:
    """Each array of ``tree`` as a ``jax.ShapeDtypeStruct`` of one device's shard."""

    def shard(leaf: Any) -> jax.ShapeDtypeStruct:
        shape = leaf.sharding.shard_shape(leaf.shape) if hasattr(leaf, "sharding") else leaf.shape
        return jax.ShapeDtypeStruct(shape, leaf.dtype)

    return jax.tree.map(shard, tree)


def _moe_shape(cfg: Any) -> tuple[int, int]:
    """(experts, top-k) of the family's MoE layers, (0, 0) without experts."""
    arch = getattr(cfg, "arch", None)
    moe = getattr(arch, "moe", None)
    if moe is None or not getattr(moe, "num_experts", 0):
        return 0, 0
    return moe.num_experts, moe.top_k


# ---------------------------------------------------------------- profile breakdown

_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


def op_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the ``op_name`` metadata (its scope path) in an HLO module."""
    scopes = {}
    for line in hlo_text.splitlines():
        match = _HLO_LINE.match(line)
        if match:
            scopes[match.group(1)] = match.group(2)
    return scopes


def category(scope: str) -> str:
    """The breakdown category of a scope path (see CATEGORIES), "other" if none."""
    parts = scope.split("/")
    if "draft_extend" in parts:
        return "draft"
    for part in parts:
        if part in CATEGORIES:
            return part
    return "other"


def trace_events(trace_dir: str | Path) -> tuple[list[dict], set[int]]:
    """The events of the newest perfetto trace under ``trace_dir``
    (``jax.profiler.trace(..., create_perfetto_trace=True)``) and the process ids of its
    devices' streams (none on a CPU)."""
    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        e["pid"]: str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return events, {pid for pid, name in names.items() if "/device:" in name}


def _timed_device_events(trace_dir: str | Path, module_hint: str):
    """(hlo op name, start, seconds) of every executed op of the trace under ``trace_dir``
    whose ``hlo_module`` contains ``module_hint``: on a GPU the device's streams only (the
    kernels' launches also appear on host threads), on CPU the XLA threads'. Start in
    seconds on the trace's clock."""
    events, devices = trace_events(trace_dir)
    for event in events:
        args = event.get("args") or {}
        if event.get("ph") != "X" or module_hint not in str(args.get("hlo_module", "")):
            continue
        if devices and event.get("pid") not in devices:
            continue
        op = args.get("hlo_op")
        if op:
            yield op, float(event["ts"]) * 1e-6, float(event.get("dur", 0.0)) * 1e-6


def _device_events(trace_dir: str | Path, module_hint: str):
    """(hlo op name, seconds) of the events of ``_timed_device_events``."""
    for op, _, dur in _timed_device_events(trace_dir, module_hint):
        yield op, dur


def device_spans(trace_dir: str | Path, module_hint: str, calls: int) -> list[dict[str, float]]:
    """Per call of a program profiled ``calls`` times in a row: ``span``, seconds from its
    first executed op's start to the latest end of its ops, and ``busy``, the seconds its
    ops ran (more than the span where ops overlap).

    The span is the device time of a step as it runs, gaps between kernels included; it is
    the one reading that holds with XLA's command buffers (CUDA graphs) on, where the
    launches that a breakdown by op would time apart are one graph. The events of
    ``_timed_device_events``, in start order, are cut into calls where the first op of the
    run starts again (every call starts with the same op, however many it runs after it: a
    conditional's branch may differ between calls), or, where that op does not start
    exactly ``calls`` times, into ``calls`` runs of equal length (ValueError when the count
    does not divide).
    """
    events = sorted(
        (start, start + dur, dur, op)
        for op, start, dur in _timed_device_events(trace_dir, module_hint)
    )
    starts = [i for i, event in enumerate(events) if event[3] == events[0][3]]
    if events and calls > 0 and len(starts) != calls and len(events) % calls == 0:
        starts = list(range(0, len(events), len(events) // calls))
    if calls <= 0 or not events or len(starts) != calls:
        raise ValueError(f"{len(events)} executed ops of {module_hint!r} are not {calls} calls")
    spans = []
    for first, end in zip(starts, starts[1:] + [len(events)]):
        run = events[first:end]
        spans.append({"span": max(e[1] for e in run) - run[0][0], "busy": sum(e[2] for e in run)})
    return spans


def device_breakdown(trace_dir: str | Path, hlo_text: str, module_hint: str) -> dict[str, float]:
    """Seconds of device (or, on CPU, XLA thread) time per category over a profiled run:
    the events of the trace under ``trace_dir`` (``jax.profiler.trace(...,
    create_perfetto_trace=True)``) whose ``hlo_module`` contains ``module_hint``, mapped to
    scopes through ``hlo_text`` (the compiled step's ``as_text()``)."""
    scopes = op_scopes(hlo_text)
    seconds: dict[str, float] = defaultdict(float)
    for op, dur in _device_events(trace_dir, module_hint):
        seconds[category(scopes.get(op, ""))] += dur
    return dict(seconds)


def device_ops(trace_dir: str | Path, hlo_text: str, module_hint: str) -> list[dict[str, Any]]:
    """Every executed op of the same events as ``device_breakdown``: its name, scope path,
    category, how many times it ran and its seconds in all, the longest first. The count
    of a step's kernels (launches) is the sum of ``count`` over the steps profiled."""
    scopes = op_scopes(hlo_text)
    ops: dict[str, dict[str, Any]] = {}
    for op, dur in _device_events(trace_dir, module_hint):
        scope = scopes.get(op, "")
        row = ops.setdefault(
            op, {"op": op, "scope": scope, "category": category(scope), "count": 0, "s": 0.0}
        )
        row["count"] += 1
        row["s"] += dur
    return sorted(ops.values(), key=lambda r: -r["s"])
