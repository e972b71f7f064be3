"""Model configuration: a Hugging Face ``config.json`` parsed into one frozen ``ModelConfig``.

The engine only needs the family-independent facts (which layers are recurrent, which hold
KV, the state shapes); each family keeps its own details in ``arch``, a frozen dataclass
defined next to the family's model code. Both hash and compare by value (tuples, never
lists), so jit takes a config as a static argument directly: equal configs built
separately share one compilation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Per-layer roles the engine cares about.
RECURRENT = "recurrent"  # holds conv + ssm state in the slot pools
ATTENTION = "attention"  # holds KV in the page pool
STATELESS = "stateless"  # MLP / MoE-only layer (Nemotron-H), no cache at all

# ModelConfig's pool sizes of a model without attention layers / without recurrent layers
_NO_ATTENTION = {"num_attention_heads": 0, "num_kv_heads": 0, "head_dim": 0}
_NO_RECURRENT = {"conv_dim": 0, "conv_kernel": 1, "ssm_heads": 0, "ssm_dim_a": 0, "ssm_dim_b": 0}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine must know about a model, family details in ``arch``."""

    family: str  # a key of registry.FAMILIES
    vocab_size: int
    hidden_size: int
    layer_roles: tuple[str, ...]  # one of RECURRENT / ATTENTION / STATELESS per layer
    # attention layers
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    # recurrent layers: conv window [conv_dim, conv_kernel - 1], state [H, d_a, d_b]
    conv_dim: int
    conv_kernel: int
    ssm_heads: int
    ssm_dim_a: int
    ssm_dim_b: int
    # tokens
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    num_mtp_layers: int  # 0 when the checkpoint has no MTP head
    arch: Any  # the family's frozen dataclass (hashable by value)

    def __post_init__(self) -> None:
        try:
            hash(self)
        except TypeError as error:
            raise TypeError(
                f"ModelConfig must hash by value (tuples, not lists; frozen arch): {error}"
            ) from None

    @property
    def num_layers(self) -> int:
        return len(self.layer_roles)

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.layer_roles) if r == RECURRENT)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.layer_roles) if r == ATTENTION)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.ssm_heads, self.ssm_dim_a, self.ssm_dim_b)

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0


def require(hf: dict[str, Any], key: str, family: str) -> Any:
    """Return ``hf[key]`` or raise a ValueError naming the missing field."""
    if key not in hf or hf[key] is None:
        raise ValueError(f"{family} config.json is missing the required field {key!r}")
    return hf[key]


def layer_roles(
    types: Sequence[str], num_layers: int, roles: dict[str, str], what: str = "layer_types"
) -> tuple[str, ...]:
    """Each layer's role (``roles`` of its type); ValueError when there are not
    ``num_layers`` types or a type is not in ``roles`` (``what`` names the field there)."""
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers={num_layers}")
    unknown = sorted(set(types) - set(roles))
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; expected {sorted(roles)}")
    return tuple(roles[t] for t in types)


def time_step_limit(value: Any) -> tuple[float, float]:
    """A Mamba2 mixer's dt clamp ``(low, high)`` from a config's ``time_step_limit`` value
    (None: ``(0, inf)``); transformers writes infinity as ``{"__float__": "Infinity"}``."""
    values = value or (0.0, float("inf"))
    low, high = (float(v.get("__float__") if isinstance(v, dict) else v) for v in values)
    return low, high


def eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def pool_sizes(attention: Any, recurrent: Any) -> dict[str, int]:
    """``ModelConfig``'s pool-size fields of a family's mixer specs, each None where the
    model has no such layers: ``attention`` an ``AttentionSpec`` (heads, KV heads, head
    dim), ``recurrent`` a ``Mamba2Dims`` or ``GDNSpec`` (conv channels and kernel, the
    state's ``state_shape``)."""
    sizes = {**_NO_ATTENTION, **_NO_RECURRENT}
    if attention is not None:
        sizes["num_attention_heads"] = attention.num_heads
        sizes["num_kv_heads"] = attention.num_kv_heads
        sizes["head_dim"] = attention.head_dim
    if recurrent is not None:
        sizes["conv_dim"], sizes["conv_kernel"] = recurrent.conv_dim, recurrent.conv_kernel
        sizes["ssm_heads"], sizes["ssm_dim_a"], sizes["ssm_dim_b"] = recurrent.state_shape
    return sizes
