"""A stage's scale method and its typed options: `method` plus `method_options`, one field each.

The one way to set a method's options (numerics/methods/catalog/*: each entry's `options_model`):

- command line: `--method gptq --method-option damping=0.02 --method-option block_columns=64` (repeatable);
- pipeline.toml: the stage's `method_options` table, `[requantize.method_options]` with `damping = 0.02`;
- Python API: `requantize_checkpoint(out, src, method="gptq", method_options={"damping": 0.02})` (or a
  `GptqOptions(damping=0.02)`).

The field keeps the keys that were given, typed by the method's model (so a pipeline config reads back as written
and a stage's defaults are never restated); `typed_method_options` gives the whole model, which is what a stage runs
with and what the manifest records. Keys the method does not take are refused naming the ones it does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

from ..numerics.methods import METHODS, method_spec
from ..plugins import parse_option_pairs
from ..stage_options import Cli

__all__ = ["MethodOptions", "checked_method_options", "method_options_field", "typed_method_options"]


def _as_mapping(value: Any) -> Any:
    """`["damping=0.02"]` (the repeated flag) or an options model, as a mapping; a mapping as is."""
    if isinstance(value, (list, tuple)):
        return parse_option_pairs(value)
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return value


MethodOptions = Annotated[
    dict[str, Any], BeforeValidator(_as_mapping), Cli("--method-option", multiple=True, metavar="KEY=VALUE")]


def method_options_field(methods: Iterable[str]) -> Any:
    """The `method_options` field of a stage whose `--method` takes `methods`: its help lists each method's options
    with their defaults, from the registry."""
    listed = []
    for name in methods:
        model = METHODS.get(name).options_model
        if model.model_fields:
            defaults = ", ".join(f"{key}={field.default}" for key, field in model.model_fields.items())
            listed.append(f"{name}: {defaults}")
    what = "; ".join(listed) if listed else "these methods take none"
    return Field(default_factory=dict, description=f"An option of the method, KEY=VALUE (repeatable; pipeline.toml: "
                                                   f"a method_options table). Options and defaults: {what}.")


def checked_method_options(method: Any, values: dict[str, Any]) -> dict[str, Any]:
    """`values` typed by `method`'s options model, only the keys given (a PluginError, a ValueError, otherwise)."""
    typed = method_spec(method).parse_options(values)
    return typed.model_dump(mode="json", include=set(values))


def typed_method_options(method: Any, values: dict[str, Any]) -> BaseModel:
    """The method's whole options model: `values` over its defaults."""
    return method_spec(method).parse_options(values)
