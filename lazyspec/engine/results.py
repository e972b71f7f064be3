"""What the engine reports: a request's outputs as ``Engine.generate`` returns them, and
its pool and queue counts (``EngineStats``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from lazyspec.scheduler.request import Req, input_token_logprobs


def request_result(req: Req, tokenizer: Any, top_logprobs_num: int = 0) -> dict:
    """``{"text", "output_ids", "meta_info"}`` of ``req`` (SGLang's shape): the text decoded
    with ``tokenizer`` (empty without one), the counts, the finish reason, and the logprobs
    the request asked for, ``top_logprobs_num`` of the top ones per position. Reads only."""
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason,
        "spec_verify_ct": req.spec_verify_ct,
    }
    if req.logprob_start_len is not None:
        meta["input_token_logprobs"] = input_token_logprobs(req)
        if top_logprobs_num:
            meta["input_top_logprobs"] = [None] * (req.logprob_start_len == 0) + [
                top[:top_logprobs_num] for top in req.input_top_logprobs
            ]
    if req.return_logprob:
        meta["output_token_logprobs"] = list(zip(req.output_logprobs, req.output_ids))
        if top_logprobs_num:
            meta["output_top_logprobs"] = [
                top[:top_logprobs_num] for top in req.output_top_logprobs
            ]
    text = tokenizer.decode(req.output_ids) if tokenizer is not None else ""
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Request and pool counts at one moment, named as ``get_server_info`` reports them."""

    num_running_requests: int
    num_waiting_requests: int
    free_state_slots: int
    cached_state_slots: int
    free_kv_tokens: int
    cached_kv_tokens: int
    state_slots: int  # total, the sink slot excluded
    kv_tokens: int  # total KV token rows, the sink page excluded
    num_retractions: int  # requests retracted so far to free KV for a decode step
