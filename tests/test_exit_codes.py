"""One exit-code mapping for every command (README "Exit codes"): a bug anywhere exits 70 with its traceback, and
each KimiNvfp4Error subclass keeps its own code. The bug is injected into the function each command calls."""

from __future__ import annotations

import importlib

import pytest

from kimi_nvfp4.cli import COMMANDS, main
from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.errors import (
    INTERNAL_ERROR_EXIT_CODE,
    CheckpointError,
    DeviceError,
    EngineProcessError,
    EngineUnavailableError,
    GateFailure,
    KimiNvfp4Error,
    OutputError,
    ResourceError,
    UnsupportedCheckpointError,
)
from kimi_nvfp4.pipeline.config import ConfigError
from kimi_nvfp4.publish.upload import HubAuthError
from kimi_nvfp4.serve_check.launcher import ServerLaunchError

# Modules that bind an injection point's function by name when first imported (`from .agent_sessions import
# generate_agent_sessions`): imported here, before any test patches, so that no patch outlives its test inside them
# (a first import during the `data` case kept the injected bug in `data.loaders`, and a later `demo` in the same
# process failed in calibrate).
for _name in ("kimi_nvfp4.data.loaders", "kimi_nvfp4.registry"):
    importlib.import_module(_name)
importlib.import_module("kimi_nvfp4.registry").pipeline_stages()  # every stage adapter module


class InjectedBug(RuntimeError):
    pass


def _raise(error):
    def boom(*args, **kwargs):
        raise error

    return boom


# command -> (the module attribute its body calls, argv after the command name; {d}: an existing folder)
INJECTION_POINTS = {
    "convert": ("kimi_nvfp4.convert.cli.convert_checkpoint", ["{d}", "{d}/out"]),
    "synth": ("kimi_nvfp4.synth.cli.create_synthetic_checkpoint", ["{d}/synth"]),
    "calibrate": ("kimi_nvfp4.calibrate.api.calibrate_checkpoint", ["{d}", "--source", "{d}", "--data", "sample"]),
    "requantize": ("kimi_nvfp4.requantize.api.requantize_checkpoint", ["{d}", "--source", "{d}"]),
    "validate": ("kimi_nvfp4.validate.api.validate_checkpoint",
                 ["{d}", "--source", "{d}", "--data", "sample", "--report", "{d}/r"]),
    "serve-check": ("kimi_nvfp4.serve_check.api.run_serve_check", ["{d}", "--report", "{d}/r"]),
    "serve-reference": ("kimi_nvfp4.serve_check.engine.EmulatorEngine", ["{d}"]),
    "publish": ("kimi_nvfp4.publish.api.publish_checkpoint", ["{d}", "me/model"]),
    # run and demo: the bug is inside a stage (convert), which the pipeline reports with the same code
    "run": ("kimi_nvfp4.convert.stage.convert_checkpoint", ["{d}/src", "{d}/out"]),
    "demo": ("kimi_nvfp4.convert.stage.convert_checkpoint", ["{d}/demo"]),
    "build-demo-model": ("kimi_nvfp4.demo_model.build.build_demo_model", ["{d}/demo_model"]),
    "data": ("kimi_nvfp4.data.agent_sessions.generate_agent_sessions", ["sessions", "--out", "{d}/s.jsonl"]),
    "check-engine": ("kimi_nvfp4.engine_check.cli.check_engine", ["{d}", "--device", "meta"]),
}


def test_every_command_has_an_injection_point():
    assert set(INJECTION_POINTS) == {c.name for c in COMMANDS}


def _exit_code(argv) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


@pytest.mark.parametrize("command", sorted(INJECTION_POINTS))
def test_an_internal_error_exits_70_with_its_traceback(command, tmp_path, monkeypatch, capsys):
    target, args = INJECTION_POINTS[command]
    (tmp_path / "src").mkdir()
    monkeypatch.setattr(target, _raise(InjectedBug("injected bug")))
    code = _exit_code([command] + [a.format(d=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert code == INTERNAL_ERROR_EXIT_CODE, err
    assert "InjectedBug: injected bug" in err and "Traceback" in err


@pytest.mark.parametrize(
    "error, code",
    [
        (GateFailure("x"), 1),
        (KimiNvfp4Error("x"), 2),
        (DataError("x"), 9),
        (ConfigError("x"), 2),
        (CheckpointError("x"), 3),
        (UnsupportedCheckpointError("x"), 3),
        (OutputError("x"), 4),
        (DeviceError("x"), 5),
        (ServerLaunchError("x"), 6),
        (HubAuthError("x"), 7),
        (EngineUnavailableError("x"), 8),
        (ResourceError("x"), 10),
        (EngineProcessError("x"), 11),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
@pytest.mark.parametrize("command", ["convert", "publish", "validate"])
def test_our_errors_keep_their_codes(command, error, code, tmp_path, monkeypatch, capsys):
    target, args = INJECTION_POINTS[command]
    monkeypatch.setattr(target, _raise(error))
    assert _exit_code([command] + [a.format(d=tmp_path) for a in args]) == code
    err = capsys.readouterr().err
    assert err.strip() == f"error: {error}" and "Traceback" not in err
