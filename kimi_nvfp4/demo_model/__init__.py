"""The bundled tiny Kimi K2 checkpoint and the code that builds it.

`DEMO_CHECKPOINT` is the folder of the shipped checkpoint (K2.6 layout, INT4 routed experts), the
default input of `kimi-nvfp4 demo` and of every test that needs a model with meaningful outputs.
Importing this package is cheap: training and export code load only when used.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEMO_CHECKPOINT: Path = Path(str(files("kimi_nvfp4") / "assets" / "tiny_k2"))

__all__ = ["DEMO_CHECKPOINT"]
