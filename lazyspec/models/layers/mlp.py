"""The dense SwiGLU MLP and its weight plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.models.layers.linear import linear
from lazyspec.models.plan import Params, linear_spec

# Logical axes of an MLP's projections: sharded by the intermediate width.
UP, DOWN = ("embed", "mlp"), ("mlp", "embed")


@jax.named_scope("mlp")
def swiglu_mlp(params: Params, x: jax.Array) -> jax.Array:
    """``down(silu(gate(x)) * up(x))``; params hold ``gate_proj`` and ``up_proj``, or one
    fused ``gate_up_proj`` (gate columns first, as Granite's ``input_linear``), and
    ``down_proj``."""
    if "gate_up_proj" in params:
        gate, up = jnp.split(linear(params["gate_up_proj"], x), 2, axis=-1)
    else:
        gate, up = linear(params["gate_proj"], x), linear(params["up_proj"], x)
    return linear(params["down_proj"], jax.nn.silu(gate) * up)


def mlp_plan(prefix: str, hidden_size: int, intermediate_size: int) -> Params:
    """Plan of a SwiGLU MLP whose projections sit under ``prefix``."""
    return {
        "gate_proj": linear_spec(f"{prefix}.gate_proj", hidden_size, intermediate_size, axes=UP),
        "up_proj": linear_spec(f"{prefix}.up_proj", hidden_size, intermediate_size, axes=UP),
        "down_proj": linear_spec(f"{prefix}.down_proj", intermediate_size, hidden_size, axes=DOWN),
    }
