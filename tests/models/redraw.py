"""Tiny transformers checkpoints of the Mamba2 hybrids (Nemotron-H, Granite 4.0-H) with
random values for the tensors transformers initialises to constants, so that no term of the
math is trivially 1 or 0. Needs torch + transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_redrawn(
    folder: str | Path,
    config_class: str,
    model_class: str,
    config_kwargs: dict[str, Any],
    seed: int,
    **redraw: Any,
):
    """Build transformers' ``model_class`` of ``config_class(**config_kwargs)`` (fp32, eval)
    from ``seed``, re-draw its constants (``redraw_constants(model, seed + 1, **redraw)``)
    and save it to ``folder``; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**config_kwargs)
    model = getattr(transformers, model_class)(config).float().eval()
    redraw_constants(model, seed + 1, **redraw)
    model.save_pretrained(str(folder))
    return model


def redraw_constants(
    model,
    seed: int,
    *,
    d_suffix: str,
    norm_suffixes: tuple[str, ...],
    embedding_suffixes: tuple[str, ...],
    embedding_scale: float,
    unit_gain: bool = False,
    buffer_suffixes: tuple[str, ...] = (),
) -> None:
    """Re-draw A_log, dt_bias, D (the parameter named ``*d_suffix``), the norm weights
    (around 1), every bias and the embeddings / lm_head (``embedding_scale`` x N(0, 1));
    with ``unit_gain`` every other matrix but the convolutions gets unit gain; buffers named
    ``*buffer_suffixes`` get 0.1 x N(0, 1). Mutates ``model``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = param.shape
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand(shape, generator=gen) * 7 + 1))
            elif name.endswith("dt_bias"):
                param.copy_(torch.rand(shape, generator=gen) * 4 - 3)
            elif name.endswith(d_suffix):
                param.copy_(torch.randn(shape, generator=gen))
            elif name.endswith(norm_suffixes):
                param.copy_(1 + 0.3 * torch.randn(shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(shape, generator=gen))
            elif name.endswith(embedding_suffixes):
                param.copy_(embedding_scale * torch.randn(shape, generator=gen))
            elif unit_gain and param.dim() >= 2 and "conv1d" not in name:
                # unit-gain projections: attention scores, routing and every branch of
                # the residual stream matter at the parity tolerance
                param.copy_(torch.randn(shape, generator=gen) * shape[-1] ** -0.5)
        for name, buffer in model.named_buffers():
            if name.endswith(buffer_suffixes) and buffer_suffixes:
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
