"""Output locations checked before the work (stage_kit/output_paths.py), the journalled two-file scheme switch
(checkpoint/scheme_journal.py: a kill between the writes never leaves our readers two disagreeing files), a
hf_quant_config.json that is not an object, and `convert --overwrite` keeping what the manifest does not list."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kimi_nvfp4.checkpoint.modelopt_config import ActivationScheme, set_activation_scheme
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.checkpoint.scheme_journal import JOURNAL_NAME, SchemeSwitch, journal_path, write_scheme_switch
from kimi_nvfp4.convert import convert_checkpoint
from kimi_nvfp4.errors import CheckpointError, OutputError
from kimi_nvfp4.stage_kit.output_paths import require_writable_dir, require_writable_file
from kimi_nvfp4.stage_kit.pairing import read_hf_quant_config


def _unwritable(tmp_path: Path) -> Path:
    """A folder this process cannot write: chmod for a normal user; root ignores modes, so /proc then."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):
        return Path("/proc/kimi-nvfp4-no-such-dir")
    return folder


def test_a_missing_folder_under_a_writable_one_is_writable(tmp_path):
    assert require_writable_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []  # nothing created, no probe left


def test_unwritable_and_file_locations_are_refused(tmp_path):
    with pytest.raises(OutputError, match="not writable"):
        require_writable_dir(_unwritable(tmp_path) / "reports", what="the validate report folder")
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="is not a folder"):
        require_writable_dir(tmp_path / "f" / "reports")
    with pytest.raises(OutputError, match="is a folder"):
        require_writable_file(tmp_path, what="--json")


def test_validate_refuses_an_unwritable_report_folder_before_reading_anything(tmp_path):
    """The check comes first: even a folder that is no checkpoint gets the output error (exit 4), not a run."""
    from kimi_nvfp4.validate.api import validate_checkpoint

    with pytest.raises(OutputError, match="validate report folder"):
        validate_checkpoint(tmp_path / "nope", tmp_path / "nope", "sample", report_dir=_unwritable(tmp_path) / "r",
                            progress=False)


def test_publish_json_path_is_checked_before_the_upload(tmp_path, capsys):
    from kimi_nvfp4.cli import main

    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as e:  # an unwritable --json: refused before the checkpoint is even read
        main(["publish", str(tmp_path), "me/model", "--json", str(tmp_path / "f" / "result.json")])
    assert e.value.code == OutputError.exit_code
    assert "--json" in capsys.readouterr().err


def test_hf_quant_config_that_is_a_list_is_a_typed_error(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="hf_quant_config.json.*expected a JSON object.*got a list"):
        read_hf_quant_config(tmp_path)


@pytest.fixture(scope="module")
def _converted_master(tmp_path_factory, _tiny_int4_checkpoint_master) -> Path:
    out = tmp_path_factory.mktemp("journal") / "out"
    convert_checkpoint(_tiny_int4_checkpoint_master, out, device="cpu", progress=False, record_stats=False,
                       fsync=False)
    return out


@pytest.fixture
def converted(_converted_master, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(_converted_master, out)
    return out


def _algos(root: Path) -> set[str]:
    config = json.loads((root / "config.json").read_text())
    hf = json.loads((root / "hf_quant_config.json").read_text())
    blocks = [config["quantization_config"]] + ([config["text_config"]["quantization_config"]]
                                                if "text_config" in config else [])
    return {b["quant_algo"] for b in blocks} | {hf["quantization"]["quant_algo"]}


def _killed_switch(root: Path, after_files: int) -> None:
    """What a kill leaves after the journal and `after_files` of the two files were written."""
    hf = json.loads((root / "hf_quant_config.json").read_text())
    config = json.loads((root / "config.json").read_text())
    hf["quantization"]["quant_algo"] = "NVFP4"
    config["quantization_config"]["quant_algo"] = "NVFP4"
    if "text_config" in config:
        config["text_config"]["quantization_config"]["quant_algo"] = "NVFP4"
    switch = SchemeSwitch(quant_algo="NVFP4", hf_quant_config=hf, config=config)
    journal_path(root).write_text(switch.model_dump_json())
    if after_files >= 1:
        (root / "hf_quant_config.json").write_text(json.dumps(hf))
    if after_files >= 2:
        (root / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("after_files", [0, 1, 2])
def test_every_reader_finishes_an_interrupted_switch(converted, after_files):
    assert _algos(converted) == {"W4A16_NVFP4"}
    _killed_switch(converted, after_files)
    CheckpointReader(converted)  # any reader of ours
    assert _algos(converted) == {"NVFP4"}
    assert not (converted / JOURNAL_NAME).exists()


def test_a_journal_that_cannot_be_read_is_refused(converted):
    _killed_switch(converted, 1)
    journal_path(converted).write_text("{broken")
    with pytest.raises(CheckpointError, match="interrupted activation-scheme switch"):
        CheckpointReader(converted)


def test_a_completed_switch_leaves_no_journal(converted):
    assert not set_activation_scheme(converted, ActivationScheme.W4A16)  # already so: nothing written
    write_scheme_switch(converted, SchemeSwitch(
        quant_algo="W4A16_NVFP4", hf_quant_config=json.loads((converted / "hf_quant_config.json").read_text()),
        config=json.loads((converted / "config.json").read_text())))
    assert not (converted / JOURNAL_NAME).exists()


def test_overwrite_keeps_unlisted_files_and_names_what_it_removes(converted, _tiny_int4_checkpoint_master):
    (converted / "notes.txt").write_text("mine")
    (converted / "results").mkdir()
    summary = convert_checkpoint(_tiny_int4_checkpoint_master, converted, method="amax", overwrite=True,
                                 device="cpu", progress=False, record_stats=False, fsync=False)
    assert (converted / "notes.txt").read_text() == "mine" and (converted / "results").is_dir()
    assert summary.overwrite_kept == ["notes.txt", "results"]
    assert "config.json" in summary.overwrite_removed
    assert any("kept 2 entries" in line and "--overwrite-unlisted" in line for line in summary.lines())
    convert_checkpoint(_tiny_int4_checkpoint_master, converted, method="int4-aware", overwrite=True,
                       overwrite_unlisted=True, device="cpu", progress=False, record_stats=False, fsync=False)
    assert not (converted / "notes.txt").exists() and not (converted / "results").exists()
