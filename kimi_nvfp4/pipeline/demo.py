"""`run_demo`: the whole pipeline on the bundled tiny K2 checkpoint, on CPU, in a few minutes.

convert -> calibrate -> validate -> serve-check (quick, against the in-process reference server) ->
publish --dry-run (the model card is written to reports/model_card_preview.md; nothing leaves the machine).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import KimiNvfp4Error
from .config import PipelineConfig, pipeline_config_from_dict
from .runner import run_pipeline
from .summary import PipelineSummary

DEFAULT_DEMO_DIR = Path("kimi-nvfp4-demo")
DEMO_REPO_ID = "your-name/tiny-k2-nvfp4-demo"  # only shown in the dry-run card; nothing is uploaded
# Small enough for a laptop CPU; the bundled model's context and the builtin agent sessions set the scale.
DEMO_CONFIG = {
    "device": "cpu",
    "calibrate": {"data": "builtin", "samples": 32, "seq_len": 256},
    "validate": {"samples": 8, "seq_len": 256},
    "serve_check": {"enabled": True, "reference": True, "quick": True},
    "publish": {"enabled": True, "dry_run": True, "repo_id": DEMO_REPO_ID},
}


def demo_checkpoint() -> Path:
    """The bundled tiny K2.6-layout INT4 checkpoint."""
    try:
        from ..demo_model import DEMO_CHECKPOINT
    except ImportError:
        raise KimiNvfp4Error("the bundled demo checkpoint is not installed (kimi_nvfp4.demo_model.DEMO_CHECKPOINT)") \
            from None
    path = Path(DEMO_CHECKPOINT)
    if not (path / "config.json").is_file():
        raise KimiNvfp4Error(f"the bundled demo checkpoint is incomplete: {path / 'config.json'} is missing "
                             "(run `kimi-nvfp4 build-demo-model` in a source checkout)")
    return path


def demo_config() -> PipelineConfig:
    return pipeline_config_from_dict(DEMO_CONFIG, origin="demo preset")


def run_demo(out_dir: str | Path | None = None, *, progress: bool = True) -> PipelineSummary:
    """Run the demo into `out_dir` (default ./kimi-nvfp4-demo); the NVFP4 checkpoint lands in `out_dir/nvfp4`.

    Re-running resumes: finished stages are skipped.
    """
    root = Path(out_dir) if out_dir is not None else DEFAULT_DEMO_DIR
    root.mkdir(parents=True, exist_ok=True)
    return run_pipeline(demo_checkpoint(), root / "nvfp4", demo_config(), progress=progress)
