"""The test suite's fixtures a bench reuses, loaded from their file (tests/ is not a package, and no bench script
edits sys.path)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from bench.harness.provenance import REPO_ROOT


def test_fixture(relative_path: str) -> ModuleType:
    """The module at `relative_path` (from the repository root), e.g. `tests/data/traffic_fixtures.py`."""
    path = REPO_ROOT / relative_path
    name = "bench_fixture_" + path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    spec.loader.exec_module(module)
    return module
