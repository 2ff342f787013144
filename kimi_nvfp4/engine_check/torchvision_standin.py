"""A stand-in `torchvision` for machines whose torchvision cannot load (the registry's wheel needs CUDA torch).

SGLang imports torchvision at module level in its multimodal processors and configs
(`sglang.srt.configs` -> `nano_nemotron_vl` -> `multimodal/internvl_utils.py`), so without it
`sglang.srt.models.kimi_k25` cannot even be imported. Loading weights never transforms an image:
the stand-in provides the modules those imports name, a real `InterpolationMode` enum (used in
default arguments at import time), and any other attribute as a callable that raises when called,
so an image path reached by mistake fails loudly instead of computing something.

transformers decides once (lru_cache) whether torchvision is usable; it is asked before the stand-in
is installed, so it keeps answering "absent" and never routes its own image processing here.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types
from collections.abc import Callable

# The modules SGLang 0.5.23 imports from torchvision (srt/configs, srt/multimodal, srt/utils/common.py).
STANDIN_MODULES = (
    "torchvision",
    "torchvision.io",
    "torchvision.ops",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's members and values."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class TorchvisionUnavailable(RuntimeError):
    """An image transform was called inside the engine check, where torchvision is a stand-in."""


def _unavailable(qualname: str) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        raise TorchvisionUnavailable(
            f"{qualname} was called, but torchvision is a stand-in in the engine check (no image is processed there)"
        )

    call.__qualname__ = qualname
    return call


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, "kimi-nvfp4 engine check stand-in for torchvision (see engine_check/torchvision_standin.py)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []

    def missing_attribute(attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _unavailable(f"{name}.{attr}")

    module.__getattr__ = missing_attribute  # PEP 562
    return module


def install_torchvision_standin() -> None:
    """Put the stand-in modules into sys.modules (once per process)."""
    from transformers.utils.import_utils import is_torchvision_available

    is_torchvision_available()  # transformers caches "absent" before the stand-in exists
    modules = {name: _module(name) for name in STANDIN_MODULES}
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    for name in ("torchvision.transforms", "torchvision.transforms.functional"):
        modules[name].InterpolationMode = InterpolationMode
    sys.modules.update(modules)


def torchvision_import_error() -> str | None:
    """None when the real torchvision imports; otherwise why not (its partial modules are removed)."""
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # a CUDA-built wheel raises RuntimeError from its operator registrations
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return f"{type(e).__name__}: {e}"
    return None
