"""Tiny transformers checkpoints of the Mamba2 hybrids (Nemotron-H, Granite 4.0-H) with
random values for the tensors transformers initialises to constants, so that no term of the
math is trivially 1 or 0. Needs torch + transformers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PatternCheckpoints:
    """A family's tiny checkpoints named by a layer pattern (one char per layer): transformers'
    ``config_class`` of ``base`` with a config's overrides and the layers of the pattern
    (``pattern_names``) under ``layers_field`` (and their count under ``num_layers_field``
    where the family wants it), saved as ``model_class`` with its constants re-drawn
    (``redraw_constants`` options ``redraw``)."""

    config_class: str
    model_class: str
    base: dict[str, Any]
    pattern_names: dict[str, str]
    layers_field: str
    num_layers_field: str | None = None
    redraw: dict[str, Any] = field(default_factory=dict)

    def hf_config_dict(self, pattern: str, overrides: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of ``config_class`` for ``pattern``."""
        config = dict(self.base)
        config.update(overrides)
        if self.num_layers_field is not None:
            config[self.num_layers_field] = len(pattern)
        config[self.layers_field] = [self.pattern_names[ch] for ch in pattern]
        return config

    def save(self, folder: str | Path, pattern: str, overrides: dict[str, Any], seed: int = 0):
        """Build, randomise and save the model of ``pattern``; returns the torch model (eval)."""
        config = self.hf_config_dict(pattern, overrides)
        classes = self.config_class, self.model_class
        return save_redrawn(folder, *classes, config, seed, **self.redraw)


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
