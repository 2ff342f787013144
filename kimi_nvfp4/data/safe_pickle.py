"""Reading SGLang's request and crash dumps without running them: a restricted unpickler.

A pickle is a program: every global it names is imported and may be called (`os.system` through `__reduce__` is
the textbook case), and SGLang's dumps hold `server_args`, which can name remote-code classes of the served model.
So `pickle.load` is never used on a dump. `load_dump` resolves globals itself:

- builtin containers and scalars (`set`, `frozenset`, `bytearray`, `complex`, `slice`, `collections.OrderedDict`,
  `collections.deque`) are the real types: they run no user code;
- every class under `sglang.` (GenerateReqInput, ServerArgs, enums, time stats, ...) becomes a `PlainRecord`
  stand-in that only stores the arguments and state it is given; the sglang module is never imported;
- `copyreg.__newobj__`/`_reconstructor` (how protocol 0-2 pickles rebuild objects) map to builders that accept
  only those stand-ins;
- anything else (`os`, `posix`, `subprocess`, `builtins.eval`, `numpy`, `torch`, ...) raises `UnsafePickleError`
  naming the file and the global, before anything it names is imported or called.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path
from typing import Any

from .errors import DataError, UnsafePickleError

# Builtin types whose construction runs no user code (pickle's own opcodes cover list, dict, tuple, str, bytes,
# int, float, bool and None without naming a global).
_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "object"): object,
    ("__builtin__", "set"): set,
    ("__builtin__", "frozenset"): frozenset,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "deque"): collections.deque,
}
# Classes from these packages are replaced by plain records (their fields are what the importers read).
_RECORD_PACKAGES = ("sglang.",)


class PlainRecord:
    """Stand-in for an sglang class: the positional arguments it was rebuilt with and its state (`fields`)."""

    module: str = ""
    qualname: str = ""

    # pickle's NEWOBJ opcode calls cls.__new__ without __init__: the record is set up there
    def __new__(cls, *args: Any, **kwargs: Any) -> PlainRecord:
        self = super().__new__(cls)
        self.args = args
        self.fields = dict(kwargs)
        return self

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    args: tuple
    fields: dict[str, Any]

    def __setstate__(self, state: Any) -> None:
        # dataclasses pickle their __dict__; slotted classes send (dict-or-None, slots-dict)
        if isinstance(state, tuple) and len(state) == 2:
            for part in state:
                if isinstance(part, dict):
                    self.fields.update(part)
        elif isinstance(state, dict):
            self.fields.update(state)
        else:
            self.fields["_state"] = state

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def __repr__(self) -> str:
        return f"PlainRecord({self.module}.{self.qualname}, fields={sorted(self.fields)})"


def _record_class(module: str, name: str) -> type[PlainRecord]:
    return type(name, (PlainRecord,), {"module": module, "qualname": name})


def _safe_newobj(cls: Any, *args: Any) -> Any:
    if isinstance(cls, type) and issubclass(cls, PlainRecord):
        return cls(*args)
    if cls in (set, frozenset, collections.OrderedDict, collections.deque, object):
        return cls.__new__(cls, *args)
    raise pickle.UnpicklingError(f"__newobj__ of {cls!r} is not allowed")


def _safe_reconstructor(cls: Any, base: Any, state: Any) -> Any:
    if isinstance(cls, type) and issubclass(cls, PlainRecord):
        return cls()
    raise pickle.UnpicklingError(f"_reconstructor of {cls!r} is not allowed")


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, path: Path):
        super().__init__(file)
        self._path = path
        self._records: dict[tuple[str, str], type[PlainRecord]] = {}

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 (pickle's hook)
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if module == "copyreg" and name == "__newobj__":
            return _safe_newobj
        if module == "copyreg" and name == "_reconstructor":
            return _safe_reconstructor
        if module.startswith(_RECORD_PACKAGES) and name.replace("_", "a").isalnum():
            key = (module, name)
            if key not in self._records:
                self._records[key] = _record_class(module, name)
            return self._records[key]
        raise UnsafePickleError(
            f"refuses the global {module}.{name}: a dump may only hold builtin containers and sglang records "
            "(nothing it names is imported or called); is this an SGLang request dump?", file=self._path)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refuses a persistent id ({type(pid).__name__}): not an SGLang request dump",
                                file=self._path)


def load_dump(path: str | Path) -> Any:
    """The object in one pickle file, read with the restricted unpickler (see the module docstring).

    :raises UnsafePickleError: the pickle names a global outside the allow-list.
    :raises DataError: the file is unreadable, truncated or not a pickle.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            return _RestrictedUnpickler(f, path).load()
    except DataError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, OSError, UnicodeDecodeError) as e:
        raise DataError(f"not a readable pickle ({type(e).__name__}: {e})", file=path) from None
