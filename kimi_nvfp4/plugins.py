"""One registry mechanism for every extension point: scale methods, engine drivers, data sources.

Shaped after compressed-tensors' `RegistryMixin` (register by name and alias, look up, list): a `Registry` holds
`Plugin` entries of one kind, each defined in one module of a catalog package and found by importing that package's
modules on first use (so `kimi-nvfp4 --help` imports none of them). An entry carries its own typed options (a
pydantic model), which stage options hold, pipeline.toml and the CLI set (`--method-option damping=0.02`), and the
manifest records (`options.model_dump()`).

Adding an extension is adding one module to the registry's catalog that defines `PLUGIN = <the entry>` (or several
in `PLUGINS = [...]`), plus its tests. `--help` and the docs list `registry.entries()`, never a hand-kept copy.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class NoOptions(BaseModel):
    """The options of an entry that takes none (any key given is refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Plugin:
    """One registered entry: what users type (`name`, `aliases`), one line for `--help` and the docs, and the
    pydantic model of its options (`NoOptions` when it has none). Subclasses add what their kind needs."""

    name: str
    description: str
    options_model: type[BaseModel] = field(default=NoOptions, kw_only=True)
    aliases: tuple[str, ...] = field(default=(), kw_only=True)

    def parse_options(self, values: Mapping[str, Any] | BaseModel | None = None) -> BaseModel:
        """This entry's options from a mapping (CLI `key=value` strings, a pipeline.toml table) or a model."""
        if isinstance(values, self.options_model):
            return values
        if isinstance(values, BaseModel):
            values = values.model_dump()
        try:
            return self.options_model.model_validate(dict(values or {}))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "options"
            known = ", ".join(self.options_model.model_fields) or "none"
            raise PluginError(f"{self.name}: option {where}: {first.get('msg')} (its options: {known})") from None


class PluginError(ValueError):
    """An unknown entry, or options an entry refuses (a usage error: the message names what would be accepted)."""


P = TypeVar("P", bound=Plugin)


class Registry(Generic[P]):
    """The entries of one kind (`kind`: "scale method", "engine", "data source"), discovered from `catalog`, a
    package whose every module defines `PLUGIN` or `PLUGINS`. Entries may also be added with `register`.

    `order`: a sort key for `names()`/`entries()` (the order of choices in `--help` and the docs); default the
    order of registration (catalog modules by name)."""

    def __init__(self, kind: str, entry_type: type[P], catalog: str | None = None, *,
                 order: Callable[[P], Any] | None = None):
        self.kind = kind
        self.entry_type = entry_type
        self.catalog = catalog
        self.order = order
        self._entries: dict[str, P] = {}
        self._aliases: dict[str, str] = {}
        self._discovered = catalog is None
        self._lock = threading.RLock()

    def register(self, entry: P) -> P:
        if not isinstance(entry, self.entry_type):
            raise TypeError(f"{self.kind} {entry!r} is not a {self.entry_type.__name__}")
        with self._lock:
            for key in (entry.name, *entry.aliases):
                normal = _normal(key)
                if normal in self._aliases:
                    raise ValueError(f"{self.kind} {key!r} is registered twice")
            for key in (entry.name, *entry.aliases):
                self._aliases[_normal(key)] = entry.name
            self._entries[entry.name] = entry
        return entry

    def _discover(self) -> None:
        with self._lock:
            if self._discovered:
                return
            package = importlib.import_module(self.catalog)
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                module = importlib.import_module(f"{self.catalog}.{info.name}")
                found = getattr(module, "PLUGINS", None) or [getattr(module, "PLUGIN", None)]
                if not found or found == [None]:
                    raise TypeError(f"{module.__name__} defines neither PLUGIN nor PLUGINS")
                for entry in found:
                    self.register(entry)
            self._discovered = True

    def get(self, name: str) -> P:
        """The entry registered under `name` or one of its aliases (case and `_`/`-` insensitive)."""
        self._discover()
        key = self._aliases.get(_normal(str(name)))
        if key is None:
            raise PluginError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self._entries[key]

    def __contains__(self, name: object) -> bool:
        self._discover()
        return isinstance(name, str) and _normal(name) in self._aliases

    def names(self) -> list[str]:
        return [entry.name for entry in self.entries()]

    def entries(self) -> list[P]:
        self._discover()
        entries = list(self._entries.values())
        return sorted(entries, key=self.order) if self.order is not None else entries

    def help_text(self) -> str:
        """`name: description` per entry, for a click option's help and the generated docs."""
        return "; ".join(f"{e.name}: {e.description}" for e in self.entries())


def _normal(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def parse_option_pairs(pairs: Iterable[str]) -> dict[str, str]:
    """`["damping=0.02", "block_size=128"]` (repeatable `--*-option KEY=VALUE` flags) as a mapping; values stay
    strings for the entry's options model to convert."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise PluginError(f"option {pair!r}: expected KEY=VALUE")
        out[key.strip().replace("-", "_")] = value.strip()
    return out
