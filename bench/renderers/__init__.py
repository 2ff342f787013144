"""Registry of docs/benchmarks.md's table renderers: one function per table, registered by the name its
`<!-- generated: NAME ... -->` marker uses. Importing a module registers its renderers."""

from . import data_import, invariance_memory, model_stages, output_aware, quality, speed, vs_modelopt  # noqa: F401,E501
from .common import REGISTRY, BenchmarkRenderError, BlockContext, ResultFile, renderer

__all__ = ["REGISTRY", "BenchmarkRenderError", "BlockContext", "ResultFile", "renderer"]
