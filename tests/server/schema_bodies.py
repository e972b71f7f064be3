"""Hypothesis strategies for the JSON values a JSON schema accepts, for the request schemas
the server publishes (``lazyspec/server/schema.py``).

It reads the keywords those schemas use (``type``, ``enum``, ``const``, ``anyOf``,
``properties`` / ``required`` / ``additionalProperties`` / ``maxProperties`` /
``propertyNames``, ``items`` / ``minItems`` / ``maxItems``, numeric bounds, string lengths and
``pattern``) and refuses any other with a ``ValueError``, so a schema that grows a keyword
this file does not know fails loudly instead of being fuzzed wrongly. Conditions that span
fields (``if`` / ``then``) are left to a final filter through ``jsonschema``: every value
drawn is valid against the whole schema. Only hypothesis' public API is used.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from hypothesis import strategies as st

Schema = dict[str, Any]
KNOWN = {
    "type", "enum", "const", "anyOf", "properties", "required", "additionalProperties",
    "maxProperties", "propertyNames", "items", "minItems", "maxItems", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "if", "then",
    "title", "description", "default",
}  # fmt: skip
# the lengths a draw may reach where a schema allows more: fuzzing needs variety, not size
MAX_DRAWN_ITEMS = 4
MAX_DRAWN_TEXT = 12
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=MAX_DRAWN_TEXT)
)


def bodies(schema: Schema) -> st.SearchStrategy:
    """Values valid against ``schema`` (checked by ``jsonschema`` as a last filter)."""
    validator = jsonschema.Draft202012Validator(schema)
    return _values(schema).filter(validator.is_valid)


def _values(schema: Schema) -> st.SearchStrategy:
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"schema keywords this generator does not read: {sorted(unknown)}")
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([_values(_merge(schema, branch)) for branch in schema["anyOf"]])
    kinds = schema.get("type")
    if kinds is None:
        kinds = ["object"] if "properties" in schema else None
    if kinds is None:
        return JSON_SCALARS
    if isinstance(kinds, str):
        kinds = [kinds]
    return st.one_of([_TYPED[kind](schema) for kind in kinds])


def _merge(schema: Schema, branch: Schema) -> Schema:
    """``branch`` with the keywords ``schema`` states beside its ``anyOf``."""
    outer = {k: v for k, v in schema.items() if k not in ("anyOf", "if", "then")}
    return {**outer, **branch}


def _integers(schema: Schema) -> st.SearchStrategy:
    low, high = schema.get("minimum"), schema.get("maximum")
    if "exclusiveMinimum" in schema:
        low = int(schema["exclusiveMinimum"]) + 1
    if "exclusiveMaximum" in schema:
        high = int(schema["exclusiveMaximum"]) - 1
    return st.integers(min_value=low, max_value=high)


def _numbers(schema: Schema) -> st.SearchStrategy:
    return st.floats(
        min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
        max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
        exclude_min="exclusiveMinimum" in schema,
        exclude_max="exclusiveMaximum" in schema,
        allow_nan=False,
        allow_infinity=False,
    )


def _strings(schema: Schema) -> st.SearchStrategy:
    if "pattern" in schema:
        return st.from_regex(schema["pattern"], fullmatch=True)
    low = schema.get("minLength", 0)
    high = min(schema.get("maxLength", low + MAX_DRAWN_TEXT), low + MAX_DRAWN_TEXT)
    return st.text(min_size=low, max_size=high)


def _arrays(schema: Schema) -> st.SearchStrategy:
    low = schema.get("minItems", 0)
    high = min(schema.get("maxItems", low + MAX_DRAWN_ITEMS), low + MAX_DRAWN_ITEMS)
    items = _values(schema["items"]) if "items" in schema else JSON_SCALARS
    return st.lists(items, min_size=low, max_size=high)


def _objects(schema: Schema) -> st.SearchStrategy:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    extra = schema.get("additionalProperties", True)
    fixed = {name: _values(sub) for name, sub in properties.items() if name in required}
    optional = {name: _values(sub) for name, sub in properties.items() if name not in required}
    drawn = st.fixed_dictionaries(fixed, optional=optional)
    if extra is False or properties:
        # an object with named fields: extra names are the spoiled bodies' job (test file)
        return drawn
    names = _strings(schema.get("propertyNames", {"type": "string"}))
    values = JSON_SCALARS if extra is True else _values(extra)
    high = min(schema.get("maxProperties", MAX_DRAWN_ITEMS), MAX_DRAWN_ITEMS)
    return st.dictionaries(names, values, max_size=high)


_TYPED = {
    "null": lambda schema: st.none(),
    "boolean": lambda schema: st.booleans(),
    "integer": _integers,
    "number": _numbers,
    "string": _strings,
    "array": _arrays,
    "object": _objects,
}
