"""The command registry: every `kimi-nvfp4` command, and which of them `kimi-nvfp4 run` chains.

One entry per command. The CLI lists and loads commands from here (kimi_nvfp4/cli.py); `run` takes the entries
that name a pipeline `stage` adapter, in this order (`pipeline_stages`). Targets are "module:attribute" strings,
imported only when used, so `kimi-nvfp4 --help` loads no stage code.

Adding a command: write it in its package's `cli.py` and add one entry. Adding a pipeline stage: also give the
entry its adapter (`<stage>/stage.py`: a class with a pipeline.toml `Section` model built on the stage's options,
stage_kit/pipeline_stage.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    name: str  # `kimi-nvfp4 NAME`
    target: str  # "module:attribute" of its click command
    summary: str  # its line in `kimi-nvfp4 --help`
    stage: str | None = None  # "module:attribute" of its pipeline adapter; `run` chains these in registry order


COMMANDS: tuple[Command, ...] = (
    Command("convert", "kimi_nvfp4.convert.cli:convert_command",
            "Convert an INT4 Kimi K2.x checkpoint to NVFP4 (ModelOpt HF format).",
            stage="kimi_nvfp4.convert.stage:ConvertStage"),
    Command("calibrate", "kimi_nvfp4.calibrate.cli:calibrate_command",
            "Write static activation scales (input_scale) from coding-agent sessions.",
            stage="kimi_nvfp4.calibrate.stage:CalibrateStage"),
    Command("requantize", "kimi_nvfp4.requantize.cli:requantize_command",
            "Rewrite the routed experts with an output-aware method (act-diag, gptq, gptq-w4a4[-diag]) from calibration "
            "statistics.",
            stage="kimi_nvfp4.requantize.stage:RequantizeStage"),
    Command("validate", "kimi_nvfp4.validate.cli:validate_command",
            "Compare the NVFP4 checkpoint with its INT4 source; exit 1 if a gate fails.",
            stage="kimi_nvfp4.validate.stage:ValidateStage"),
    Command("serve-check", "kimi_nvfp4.serve_check.cli:serve_check_command",
            "Serve the checkpoint with SGLang and measure it under coding-agent load.",
            stage="kimi_nvfp4.serve_check.stage:ServeCheckStage"),
    Command("publish", "kimi_nvfp4.publish.cli:publish_command",
            "Upload a converted, validated checkpoint to the Hugging Face Hub.",
            stage="kimi_nvfp4.publish.stage:PublishStage"),
    Command("synth", "kimi_nvfp4.synth.cli:synth_command",
            "Write a synthetic K2.6-layout INT4 checkpoint (tests, benchmarks)."),
    Command("serve-reference", "kimi_nvfp4.serve_check.cli:serve_reference_command",
            "Serve a checkpoint through the reference emulator (SGLang's HTTP subset)."),
    Command("run", "kimi_nvfp4.pipeline.cli:run_command",
            "Run convert -> calibrate [-> requantize] -> validate [-> serve-check] [-> publish]."),
    Command("demo", "kimi_nvfp4.pipeline.cli:demo_command",
            "Run the whole pipeline on the bundled tiny K2 model on CPU."),
    Command("build-demo-model", "kimi_nvfp4.demo_model.cli:build_demo_model_command",
            "Train and export the bundled tiny K2 checkpoint (reproducible)."),
    Command("data", "kimi_nvfp4.data.cli:data_command",
            "Generate, inspect and split coding-agent session data."),
    Command("check-engine", "kimi_nvfp4.engine_check.cli:check_engine_command",
            "Load the checkpoint with SGLang's (or vLLM's) own code on CPU; exit 1 on any miss."),
)


def find_command(name: str) -> Command | None:
    return next((c for c in COMMANDS if c.name == name), None)


def load_target(target: str) -> Any:
    """Import "module:attribute" and return the attribute."""
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def pipeline_stages() -> list[Any]:
    """The adapter classes of the pipeline stages (`Command.stage`), in pipeline order."""
    return [load_target(command.stage) for command in COMMANDS if command.stage is not None]
