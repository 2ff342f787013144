"""Where the fused Triton kernels are available: one lookup for every module of them."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """`kimi_nvfp4.numerics.<name>`, a module of Triton kernels, where Triton is installed (it comes with CUDA
    builds of torch), else None. Importing it defines (compiles lazily) its kernels, so it is imported on first use."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module(f"{__package__}.{name}")
