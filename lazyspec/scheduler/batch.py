"""Host-side batch arrays: a scheduled step's rows as padded numpy arrays of a bucket shape.

One function per step kind builds the whole array set (padding rows point at the null
slot / null page and a sentinel request row, so the device step drops their writes); the
runner turns it into the device pytree.
"""

from __future__ import annotations

import zlib

import numpy as np

from lazyspec.scheduler.request import Req


def extend_arrays(rows: int, length: int, ctx: int, num_slots: int, max_reqs: int):
    sentinel_slot = num_slots + 1
    a = {
        "req_row": np.full(rows, max_reqs + 1, np.int32),
        "tokens": np.zeros((rows, length), np.int32),
        "start_pos": np.zeros(rows, np.int32),
        "num_new": np.zeros(rows, np.int32),
        "kv_read_idx": np.zeros((rows, ctx), np.int32),
        "state_src_slot": np.zeros(rows, np.int32),
        "working_slot": np.full(rows, sentinel_slot, np.int32),
        "track_slot": np.full(rows, sentinel_slot, np.int32),
        "track_chunk": np.zeros(rows, np.int32),
        "is_last_chunk": np.zeros(rows, bool),
        "next_token": np.zeros(rows, np.int32),
    }
    a.update(sampling_arrays(rows))
    return a


def decode_arrays(rows: int, ctx: int, num_slots: int, max_reqs: int, interval: int):
    sentinel_slot = num_slots + 1
    a = {
        "track_interval": np.asarray(interval, np.int32),
        "req_row": np.full(rows, max_reqs + 1, np.int32),
        "kv_read_idx": np.zeros((rows, ctx), np.int32),
        "working_slot": np.full(rows, sentinel_slot, np.int32),
        "track_slot": np.full(rows, sentinel_slot, np.int32),
    }
    a.update(sampling_arrays(rows))
    return a


def sampling_arrays(rows: int) -> dict[str, np.ndarray]:
    return {
        "temperature": np.zeros(rows, np.float32),
        "top_p": np.ones(rows, np.float32),
        "top_k": np.full(rows, -1, np.int32),
        "seed": np.zeros(rows, np.uint32),
    }


def fill_sampling(a: dict[str, np.ndarray], b: int, req: Req) -> None:
    a["temperature"][b] = req.sampling.temperature
    a["top_p"][b] = req.sampling.top_p
    a["top_k"][b] = req.sampling.top_k
    seed = req.sampling.seed if req.sampling.seed is not None else zlib.crc32(req.rid.encode())
    a["seed"][b] = np.uint32(seed & 0xFFFFFFFF)
