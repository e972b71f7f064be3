"""The tree-slot oracle: every state the radix cache holds equals a cache-free recompute.

``TreeStateOracle(engine)`` is an integrity hook (``engine.run_until_done(reqs,
check=oracle)``): after a step it runs ``Engine.check_integrity`` and then compares the
slot of every tree node that holds a state with the state after the node's token prefix,
recomputed from zeros by a separate engine with the radix cache off (one request, no
overlap). Recomputes are cached per prefix, so each distinct prefix costs one prefill.

The two states come from differently chunked scans (and decode-time checkpoints from the
token recurrence), so they agree to rounding, not bit for bit; a stale or clobbered slot
(the state of another length or another prompt) is off by the state's own size.
"""

from __future__ import annotations

import numpy as np

RTOL = 1e-3  # of the state's largest magnitude; rounding is ~1e-6 of it in float32


class TreeStateOracle:
    def __init__(self, engine, rtol: float = RTOL) -> None:
        from lazyspec.engine.engine import Engine

        c = engine.config
        self.engine = engine
        self.rtol = rtol
        self.reference = Engine(
            model=engine.model,
            dtype=c.dtype,
            mamba_ssm_dtype=c.mamba_ssm_dtype,
            mamba_chunk_size=c.mamba_chunk_size,
            chunked_prefill_size=c.chunked_prefill_size,
            context_length=engine.layout.context_len,
            max_total_tokens=engine.layout.context_len,
            max_running_requests=1,
            kernel_backend=c.kernel_backend,
            disable_radix_cache=True,
            disable_overlap_schedule=True,
            skip_warmup=True,
        )
        self._states: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.num_checked = 0  # node states compared (a test can assert it is not vacuous)

    def __call__(self, engine) -> None:
        engine.check_integrity()
        for node in engine.tree.iter_nodes():
            if node.state_slot is not None:  # a state only on the host tier: not compared
                self._check_node(node)

    def _check_node(self, node) -> None:
        prefix = _prefix(node)
        want = self.state_after(prefix)
        got = self.engine.runner.read_slot(node.state_slot)
        for name, w, g in zip(("conv", "ssm"), want, got):
            scale = max(float(np.abs(w).max()), 1.0)
            err = float(np.abs(w - g.astype(w.dtype)).max())
            assert err <= self.rtol * scale, (
                f"tree slot {node.state_slot} (node {node.node_id}, {len(prefix)} tokens): "
                f"{name} differs from the cache-free recompute by {err:.3g} (scale {scale:.3g})"
            )
        self.num_checked += 1

    def state_after(self, tokens: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(conv, ssm) after ``tokens`` from zeros, as the reference engine computes it."""
        if tokens not in self._states:
            ref = self.reference
            req = ref.add_request(
                input_ids=list(tokens), sampling_params={"max_new_tokens": 2, "ignore_eos": True}
            )
            while req.output_ids == [] and not req.finished:
                ref.step()  # prefill; the working slot then holds the state after the prompt
            assert not req.finished, req.finish_reason
            conv, ssm = ref.runner.read_slot(req.slots.working)
            self._states[tokens] = (conv.astype(np.float32), ssm.astype(np.float32))
            assert ref.abort(req.rid)
        return self._states[tokens]


def _prefix(node) -> tuple[int, ...]:
    """The token ids from the root to the end of ``node``'s edge."""
    keys = []
    while node is not None and not node.is_root:
        keys.append(node.key)
        node = node.parent
    return tuple(int(t) for key in reversed(keys) for t in key)
