"""Reading the routed-experts kernel's tables back as each token's experts, for tests and
the device check (``scripts/check_kernels.py``)."""

from __future__ import annotations

import numpy as np

from lazyspec.kernels.moe.grouping import ExpertTiles


def expert_picks(tiles: ExpertTiles, block_rows: int) -> list[dict[int, float]]:
    """Each token's ``{expert: weight}`` as the kernels read them: a pair's row names its
    tile (``pair_row // block_rows``), the tile names its expert and the row carries the
    weight; rows past the tiles are dropped pairs. ValueError if a pair's row is not its
    token's row of the tile, or two tiles name one expert."""
    tile_expert, row_weight = np.asarray(tiles.tile_expert), np.asarray(tiles.row_weight)
    used = tile_expert[tile_expert >= 0]
    if len(set(used.tolist())) != len(used):
        raise ValueError(f"an expert names two tiles: {tile_expert}")
    picks = []
    for token, rows in enumerate(np.asarray(tiles.pair_row)):
        kept = [int(r) for r in rows if r < tile_expert.size * block_rows]
        if any(r % block_rows != token for r in kept):
            raise ValueError(f"token {token}'s pairs sit on other tokens' rows: {rows}")
        picks.append({int(tile_expert[r // block_rows]): float(row_weight[r]) for r in kept})
    return picks


def router_picks(weights, expert_ids, shared=None) -> list[dict[int, float]]:
    """Each token's ``{expert: weight}`` from ``[N, k]`` weights and expert ids; ``shared``:
    (the shared expert's id, its weight per token ``[N]``), added to every token's."""
    weights, expert_ids = np.asarray(weights), np.asarray(expert_ids)
    picks = [{int(e): float(w) for e, w in zip(ids, ws)} for ids, ws in zip(expert_ids, weights)]
    if shared is not None:
        shared_id, shared_weight = shared
        for pick, weight in zip(picks, np.asarray(shared_weight)):
            pick[int(shared_id)] = float(weight)
    return picks


def picks_differ(got: list[dict[int, float]], want: list[dict[int, float]], rtol: float) -> str:
    """'' where every token has the same experts with weights within ``rtol``, else what
    differs first."""
    for token, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.keys() != w.keys():
            return f"token {token}: experts {sorted(g)} against {sorted(w)}"
        for e, weight in w.items():
            if abs(g[e] - weight) > rtol * abs(weight):
                return f"token {token}, expert {e}: weight {g[e]} against {weight}"
    return ""
