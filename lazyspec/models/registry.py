"""The model registry: which families exist, how a config names one, and ``load_model``.

One table (``FAMILIES``) maps a Hugging Face ``model_type`` to the module that implements
the family (the functions of ``interface.ModelFamily``) and the ``architectures`` name its
checkpoints carry; ``VARIANTS`` adds the further model_types a family's module parses.
Family modules are imported on first use, so reading a config never imports a family it
does not name.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazyspec.models.config import ModelConfig
from lazyspec.models.interface import ModelFamily
from lazyspec.models.loader import SafetensorsReader, load_tokenizer
from lazyspec.models.model import Model
from lazyspec.models.plan import Placement, init_plan

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")  # SGLang's names: read the safetensors, or random weights


@dataclass(frozen=True)
class FamilyEntry:
    module: str  # implements interface.ModelFamily
    architecture: str  # the ``architectures`` name in the checkpoint's config.json


FAMILIES: dict[str, FamilyEntry] = {
    "qwen3_next": FamilyEntry("lazyspec.models.qwen3_next", "Qwen3NextForCausalLM"),
    "nemotron_h": FamilyEntry("lazyspec.models.nemotron_h", "NemotronHForCausalLM"),
    "granitemoehybrid": FamilyEntry("lazyspec.models.granite", "GraniteMoeHybridForCausalLM"),
    "qwen3_5": FamilyEntry("lazyspec.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
}

# Further model_types a registered family parses: model_type -> (family, architecture).
VARIANTS: dict[str, tuple[str, str]] = {
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "qwen3_5_moe_text": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
}


def family_architectures(family: str) -> list[str]:
    """The ``architectures`` names whose checkpoints ``family`` loads."""
    names = [FAMILIES[family].architecture]
    return sorted(set(names + [arch for fam, arch in VARIANTS.values() if fam == family]))


def supported_architectures() -> list[str]:
    return sorted({name for family in FAMILIES for name in family_architectures(family)})


def family_of(model_type: str | None) -> str | None:
    """The family that parses configs of ``model_type``, or None."""
    if model_type in FAMILIES:
        return model_type
    return VARIANTS[model_type][0] if model_type in VARIANTS else None


def family_module(family: str) -> ModelFamily:
    """The module implementing ``family`` (``ValueError`` naming the supported ones)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; supported: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[family].module)


def parse_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Parse a Hugging Face config dict. ValueError naming the supported architectures for
    an unknown model_type, or for ``architectures`` (when given) of which the family loads
    none (another head on a known decoder, e.g. a sequence classifier)."""
    model_type = hf.get("model_type")
    architectures = hf.get("architectures")
    family = family_of(model_type)
    if family is None:
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures={architectures!r}); "
            f"supported: {supported_architectures()}"
        )
    if architectures is not None and (
        not isinstance(architectures, list)
        or not set(family_architectures(family)).intersection(
            a for a in architectures if isinstance(a, str)
        )
    ):
        raise ValueError(
            f"unsupported architectures={architectures!r} for model_type {model_type!r}; "
            f"supported: {supported_architectures()}"
        )
    return family_module(family).parse_config(hf)


def load_model_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a model folder and parse it."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model folder {str(path)!r}")
    with open(config_path) as f:
        return parse_hf_config(json.load(f))


def load_model(
    path: str | Path,
    dtype: str = "float32",
    place: Placement | None = None,
    load_format: str = "auto",
    seed: int = 0,
) -> Model:
    """Load a Hugging Face model folder (config.json, safetensors, tokenizer.json).

    When the config declares an MTP head the checkpoint lacks, the returned config has
    ``num_mtp_layers = 0`` (logged), so ``Model.has_mtp`` and the config agree. ``place``
    (see ``plan.load_plan``): each device reads only its blocks of the tensors.
    ``load_format="dummy"`` reads no tensor: random weights from ``seed`` (MTP head included
    when the config declares one), each device drawing its own blocks with ``place``.
    """
    import jax
    import jax.numpy as jnp

    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {DTYPES}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {list(LOAD_FORMATS)}")
    cfg = load_model_config(path)
    family = family_module(cfg.family)
    if load_format == "dummy":
        heads = {"mtp": None} if cfg.has_mtp else {}
        if not cfg.tie_word_embeddings:
            heads["lm_head"] = None
        plan = family.weight_plan(cfg, heads)
        params = init_plan(plan, jax.random.PRNGKey(seed), jnp.dtype(dtype), place=place)
        return Model(cfg, params, load_tokenizer(path), family)
    params = family.load_params(cfg, SafetensorsReader(path), jnp.dtype(dtype), place=place)
    if cfg.has_mtp and "mtp" not in params:
        logger.warning(
            "config declares %d MTP layer(s) but the checkpoint has no mtp.* "
            "tensors; speculative decoding with MTP is unavailable",
            cfg.num_mtp_layers,
        )
        cfg = dataclasses.replace(cfg, num_mtp_layers=0)
    return Model(cfg, params, load_tokenizer(path), family)
