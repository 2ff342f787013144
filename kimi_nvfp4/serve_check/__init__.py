"""serve_check: launch SGLang (or attach to a server), load it like coding agents do, smoke-test quality.

Public API (imported lazily so `from kimi_nvfp4.serve_check.profiles import ...` stays light):
`run_serve_check`, `ServeCheckReport`, `CheckKind`, `LoadConfig`, `LoadTooLarge`, `QualityConfig`,
`Gates`, `ReferenceServer`, `EmulatorEngine`. See docs/serve_check.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run_serve_check": "api",
    "raise_on_failure": "api",
    "ServeCheckReport": "report",
    "QualityConfig": "report",
    "Gates": "report",
    "LoadConfig": "workload",
    "LoadTooLarge": "workload",
    "CheckKind": "report",
    "ReferenceServer": "reference_server",
    "EmulatorEngine": "engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
