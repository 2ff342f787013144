"""`StageOptions`: a stage's options declared once, as one pydantic model, and read by its click command, its
`pipeline.toml` section and its Python API.

A stage lists its options in `<stage>/options.py` as fields of a `StageOptions` subclass (`extra="forbid"`, so a
misspelt key is an error that names it). One field is one option everywhere:

- its `description` is the `--help` text; its type and constraints give the click type (an Enum or Literal
  becomes a choice, `Field(ge=1)` an `IntRange`, a list a repeatable option, a bool a flag or `--x/--no-x` switch);
  a `Cli(...)` marker in `Annotated[...]` renames the flag or sets what the type cannot say;
- `@cli_options(Model)` adds those click options to a command and hands it one validated `options` model;
- `Model.build(options, overrides, "fn")` lets a stage function take either an options model or the same
  options as keywords (`convert_checkpoint(src, out, workers=4)`);
- the pipeline's `[stage]` sections are the same models plus the pipeline's own keys (`<stage>/stage.py`).

Inputs (folders, `--data`, report folders) and presentation (`--json`, `--no-progress`) are not options: they stay
arguments of the function and the command.
"""

from __future__ import annotations

import enum
import functools
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

import annotated_types
import click
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

OptionsT = TypeVar("OptionsT", bound="StageOptions")
CommandT = TypeVar("CommandT", bound=Callable[..., Any])


class Cli:
    """How a field appears on the command line where `--field-name` with the type's defaults does not fit.

    `Cli("--kv-cache")` renames the flag, `Cli("--stats/--no-stats")` names a switch's two halves; `choices`
    replaces the type's values in the click choice (e.g. "none" for None), `click_type` the whole click type
    (e.g. `click.Path(exists=True)`); `multiple=True` makes a repeatable option of strings whatever the field's
    type (its validator parses the list, e.g. `--method-option KEY=VALUE`); `hidden=True` keeps the field off the
    command line (pipeline.toml and the Python API only).
    """

    def __init__(self, *decls: str, choices: tuple[str, ...] | None = None, click_type: Any = None,
                 show_default: bool | None = None, metavar: str | None = None, hidden: bool = False,
                 multiple: bool = False):
        self.decls = decls
        self.choices = choices
        self.click_type = click_type
        self.show_default = show_default
        self.metavar = metavar
        self.hidden = hidden
        self.multiple = multiple


class StageOptions(BaseModel):
    """Base of every stage's options model: unknown keys are errors, instances are values (frozen)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def build(cls: type[OptionsT], options: OptionsT | None, overrides: dict[str, Any], caller: str) -> OptionsT:
        """The options a stage function runs with: `options` (or the defaults) with keyword `overrides` on top.

        An unknown keyword raises TypeError as Python does for a function; a bad value raises pydantic's
        ValidationError (a ValueError) naming the option.
        """
        unknown = [key for key in overrides if key not in cls.model_fields]
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        if options is None:
            return cls(**overrides)
        if not isinstance(options, cls):
            raise TypeError(f"{caller}() options must be {cls.__name__}, got {type(options).__name__}")
        if not overrides:
            return options
        chosen = {key: getattr(options, key) for key in options.model_fields_set}
        return cls.model_validate({**chosen, **overrides})


def _cli_marker(field: FieldInfo) -> Cli:
    return next((m for m in field.metadata if isinstance(m, Cli)), Cli())


def _without_none(annotation: Any) -> Any:
    """`X | None` -> X (an option left out is the model's default, None or not)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _bounds(field: FieldInfo) -> tuple[Any, Any]:
    low = next((m.ge for m in field.metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in field.metadata if isinstance(m, annotated_types.Le)), None)
    return low, high


def _click_type(owner: str, annotation: Any, field: FieldInfo, marker: Cli) -> Any:
    if marker.click_type is not None:
        return marker.click_type
    if marker.choices is not None:
        return click.Choice(list(marker.choices))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return click.Choice([m.value for m in annotation])
    if typing.get_origin(annotation) is Literal:
        return click.Choice([str(v) for v in typing.get_args(annotation) if v is not None])
    low, high = _bounds(field)
    if annotation is int:
        return click.IntRange(min=low, max=high) if low is not None or high is not None else int
    if annotation is float:
        return click.FloatRange(min=low, max=high) if low is not None or high is not None else float
    if annotation is str:
        return str
    if annotation is Path:
        return click.Path(path_type=Path)
    raise TypeError(f"{owner}: no command-line form for {annotation!r}; give it Cli(click_type=...) or "
                    "Cli(hidden=True)")


def _click_option(model: type[StageOptions], name: str, field: FieldInfo) -> Callable[[CommandT], CommandT]:
    owner = f"{model.__name__}.{name}"
    marker = _cli_marker(field)
    flag = "--" + name.replace("_", "-")
    default = field.get_default(call_default_factory=True)
    annotation = _without_none(field.annotation)
    attrs: dict[str, Any] = {"help": field.description, "metavar": marker.metavar}
    if annotation is bool:
        # False by default: a plain flag; True by default: a switch, so the default can be turned off.
        decls = marker.decls or ((flag,) if not default else (f"{flag}/--no-{flag[2:]}",))
        attrs.update(is_flag=True, default=bool(default), show_default=bool(default) if marker.show_default is None
                     else marker.show_default)
        return click.option(*decls, name, **attrs)
    if marker.multiple:
        attrs.update(multiple=True, type=marker.click_type or str)
        default = ()
    elif typing.get_origin(annotation) in (list, tuple) and marker.click_type is None:
        item = typing.get_args(annotation)[0]
        attrs.update(multiple=True, type=_click_type(owner, item, field, marker))
        default = tuple(_plain(v) for v in default or ())
    else:
        # A sequence given one `click_type` value (e.g. a quoted string of flags) is parsed by the model's
        # validator; left out, it is the model's (empty) default.
        attrs["type"] = _click_type(owner, annotation, field, marker)
        default = None if isinstance(default, (list, tuple)) and not default else _plain(default)
    attrs.update(default=default, show_default=default not in (None, ()) if marker.show_default is None
                 else marker.show_default)
    return click.option(*(marker.decls or (flag,)), name, **attrs)


def _plain(value: Any) -> Any:
    """What click shows and parses: an Enum by its value."""
    return value.value if isinstance(value, enum.Enum) else value


def cli_fields(model: type[StageOptions]) -> list[str]:
    """The fields of `model` that are command-line options, in declaration order."""
    return [name for name, field in model.model_fields.items() if not _cli_marker(field).hidden]


def options_from_cli(model: type[OptionsT], values: dict[str, Any]) -> OptionsT:
    """Validate command-line values into `model`; a rejected value is a usage error (exit 2) naming its flag."""
    try:
        return model.model_validate({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()})
    except ValidationError as e:
        first = e.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else ""
        field = model.model_fields.get(name)
        if field is None or _cli_marker(field).hidden:  # e.g. serve-check's load table, built from several flags
            where = ".".join(str(p) for p in first["loc"])
            raise click.UsageError(f"{where}: {first['msg']}") from None
        flag = (_cli_marker(field).decls or ("--" + name.replace("_", "-"),))[0]
        raise click.BadParameter(first["msg"], param_hint=flag.split("/")[0]) from None


def cli_options(model: type[StageOptions]) -> Callable[[CommandT], CommandT]:
    """Decorate a click command function: one click option per field of `model` (at this decorator's place in
    the option list), and the command receives them as one validated `options=model(...)` keyword."""
    names = cli_fields(model)

    def decorate(fn: CommandT) -> CommandT:
        @functools.wraps(fn)  # copies fn's __click_params__ (the options declared below this decorator)
        def command(**kwargs: Any) -> Any:
            kwargs["options"] = options_from_cli(model, {name: kwargs.pop(name) for name in names})
            return fn(**kwargs)

        for name in reversed(names):  # applied last field first, as stacked decorators are
            command = _click_option(model, name, model.model_fields[name])(command)
        return typing.cast(CommandT, command)

    return decorate
