"""Faults an operator or an attacker can cause around convert, each a case that once went wrong.

(Malformed sources: tests/checkpoint/test_malformed.py. Disk full / read-only output: test_write_errors.py.)
"""

from __future__ import annotations

import json

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME
from kimi_nvfp4.convert import convert_checkpoint


def test_our_own_artifact_names_are_never_copied_from_a_source(source, tmp_path):
    """A source shipping `reports/validate_report.json` with "passed": true (and a manifest, an input-scales shard,
    calibrate's folder) must not hand later stages a verdict they never reached."""
    forged = {"passed": True, "gates": []}
    (source / "reports").mkdir()
    (source / "reports" / "validate_report.json").write_text(json.dumps(forged))
    (source / "reports" / "notes.md").write_text("# all good")
    (source / "calibration").mkdir()
    (source / "calibration" / "calibration_report.json").write_text("{}")
    (source / "extra").mkdir()
    (source / "extra" / "validate_report.json").write_text(json.dumps(forged))
    (source / MANIFEST_NAME).write_text(json.dumps({"complete": True}))
    (source / "model-input-scales.safetensors").write_bytes(b"\0" * 8)
    (source / "LICENSE").write_text("MIT")
    out = tmp_path / "out"
    summary = convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    assert not (out / "reports").exists() and not (out / "calibration").exists()
    assert not (out / "extra" / "validate_report.json").exists()
    assert not (out / "model-input-scales.safetensors").exists()
    assert json.loads((out / MANIFEST_NAME).read_text())["complete"] is True  # ours, not the source's
    assert (out / "LICENSE").read_text() == "MIT"
    skipped = {line.split(" ")[0] for line in summary.skipped_files}
    assert skipped == {"reports/validate_report.json", "reports/notes.md", "calibration/calibration_report.json",
                       "extra/validate_report.json", MANIFEST_NAME, "model-input-scales.safetensors"}
    assert any("not copied from the source: reports/validate_report.json" in line for line in summary.lines())


# --- one writer per output folder ------------------------------------------------------------------------------


def _holder(folder):
    import importlib.util
    import sys
    from pathlib import Path

    name = "kimi_nvfp4_tests_lock_holder"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "checkpoint" / "test_output_lock.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].Holder(folder)


def _run_cli(argv):
    from kimi_nvfp4.cli import main

    try:
        main(argv)
    except SystemExit as e:
        return e.code
    return 0


def test_a_second_convert_into_a_busy_folder_exits_4_naming_the_holder(source, tmp_path, capsys):
    out = tmp_path / "out"
    with _holder(out) as other:
        code = _run_cli(["convert", str(source), str(out), "--method", "amax", "--overwrite", "--device", "cpu",
                         "--no-progress"])
        err = capsys.readouterr().err
        assert code == 4 and f"in use by pid {other.pid} (kimi-nvfp4 convert" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == [".kimi_nvfp4.lock"]  # nothing written, nothing deleted
    convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)


def test_every_writing_stage_takes_the_lock(source, tmp_path):
    import pytest

    from kimi_nvfp4.calibrate import calibrate_checkpoint
    from kimi_nvfp4.errors import OutputError
    from kimi_nvfp4.pipeline.runner import run_pipeline
    from kimi_nvfp4.publish import publish_checkpoint
    from kimi_nvfp4.validate import validate_checkpoint

    out = tmp_path / "out"
    out.mkdir()
    calls = {
        "calibrate": lambda: calibrate_checkpoint(out, source, "sample", device="cpu", progress=False),
        "validate": lambda: validate_checkpoint(out, source, "sample", report_dir=tmp_path / "r", device="cpu",
                                                progress=False),
        "validate (reports inside)": lambda: validate_checkpoint(out, source, "sample", report_dir=out / "reports",
                                                                 record_in_manifest=False, progress=False),
        "publish": lambda: publish_checkpoint(out, "me/model", progress=False),
        "run": lambda: run_pipeline(source, out, progress=False),
    }
    with _holder(out) as other:
        for stage, call in calls.items():
            with pytest.raises(OutputError, match=f"in use by pid {other.pid}"):
                call()
            assert sorted(p.name for p in out.iterdir()) == [".kimi_nvfp4.lock"], stage


# --- what a resume trusts ---------------------------------------------------------------------------------------


def _flip_last_byte_as_a_new_file(path):
    """What another process's atomic rename leaves: a file of the same size with other bytes."""
    import os

    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    tmp = path.with_name(path.name + ".other")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def test_resume_does_not_trust_a_same_size_shard_another_process_replaced(source, tmp_path, monkeypatch):
    from kimi_nvfp4.checkpoint.manifest import load_manifest, save_manifest
    from kimi_nvfp4.checkpoint.writer import sha256_file
    from kimi_nvfp4.convert import output

    out = tmp_path / "out"
    convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    manifest = load_manifest(out)
    recorded = {f: r.sha256 for f, r in manifest.shards.items()}
    victim = sorted(recorded)[1]
    _flip_last_byte_as_a_new_file(out / victim)
    manifest.complete = False  # an interrupted run, resumed
    save_manifest(out, manifest)
    hashed = []
    real = output.sha256_file
    monkeypatch.setattr(output, "sha256_file", lambda p: (hashed.append(p.name), real(p))[1])
    again = convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    assert hashed == [victim]  # only the file that is not the one convert wrote is re-read
    assert again.shards_converted == 1 and sha256_file(out / victim) == recorded[victim]


def test_resume_redoes_a_shard_recorded_with_other_settings(source, tmp_path):
    from kimi_nvfp4.checkpoint.manifest import ConversionSettings, conversion_sha256, load_manifest, save_manifest

    out = tmp_path / "out"
    convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    manifest = load_manifest(out)
    victim = sorted(manifest.shards)[2]
    other = ConversionSettings(method="int4-aware", kv_cache_quant_algo="FP8")
    manifest.shards[victim].settings_sha256 = conversion_sha256(other, manifest.source.fingerprint)
    manifest.complete = False
    save_manifest(out, manifest)
    again = convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    assert again.shards_converted == 1
    assert load_manifest(out).shards[victim].settings_sha256 == conversion_sha256(manifest.settings,
                                                                                   manifest.source.fingerprint)


# --- nesting ------------------------------------------------------------------------------------------------------


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_an_output_inside_the_source_is_refused_before_anything_is_written(source, tmp_path, capsys):
    before = _tree(source)
    code = _run_cli(["convert", str(source), str(source / "nvfp4"), "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 4 and "lies inside the source folder" in err and len(err.splitlines()) == 1
    (tmp_path / "link").symlink_to(source)  # the same through a symlink
    code = _run_cli(["convert", str(source), str(tmp_path / "link" / "nvfp4"), "--device", "cpu", "--no-progress"])
    assert code == 4 and "lies inside the source folder" in capsys.readouterr().err
    code = _run_cli(["convert", str(source), str(tmp_path / "link"), "--device", "cpu", "--no-progress"])
    assert code == 4 and "is the source folder" in capsys.readouterr().err
    assert _tree(source) == before


def test_overwrite_never_deletes_a_source_inside_the_output(source, tmp_path):
    import shutil

    import pytest

    from kimi_nvfp4.errors import OutputError

    out = tmp_path / "out"
    convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    inner = out / "kimi-int4"
    shutil.copytree(source, inner)
    before = _tree(inner)
    with pytest.raises(OutputError, match="lies inside the output folder.*--overwrite would delete it"):
        convert_checkpoint(inner, out, method="int4-aware", overwrite=True, device="cpu", progress=False)
    assert _tree(inner) == before


def test_run_refuses_nesting_before_creating_the_output(source, tmp_path):
    import pytest

    from kimi_nvfp4.errors import OutputError
    from kimi_nvfp4.pipeline.runner import run_pipeline

    before = _tree(source)
    with pytest.raises(OutputError, match="lies inside the source folder"):
        run_pipeline(source, source / "out", progress=False)
    assert _tree(source) == before


# --- links and special files in the source ------------------------------------------------------------------------


def test_only_regular_files_inside_the_source_are_copied(source, tmp_path):
    import os

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("api-key=hunter2")
    (outside / "dir").mkdir()
    (outside / "dir" / "more.txt").write_text("secret too")
    (source / "notes.txt").symlink_to(outside / "secret")
    (source / "x").symlink_to("/dev/zero")
    (source / "docs").symlink_to(outside / "dir")
    (source / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(source / "pipe")  # copying it would block forever
    (source / "template_alias.jinja").symlink_to("chat_template.jinja")  # inside the source: its bytes are copied
    out = tmp_path / "out"
    summary = convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    for name in ("notes.txt", "x", "docs", "dangling", "pipe"):
        assert not os.path.lexists(out / name), name
    alias = out / "template_alias.jinja"
    assert not alias.is_symlink() and alias.read_bytes() == (source / "chat_template.jinja").read_bytes()
    skipped = {line.split(" ")[0]: line for line in summary.skipped_files}
    assert set(skipped) == {"notes.txt", "x", "docs", "dangling", "pipe"}
    assert "outside the source" in skipped["notes.txt"] and "outside the source" in skipped["x"]
    assert "not a regular file" in skipped["pipe"] and "folder" in skipped["docs"]
    assert "hunter2" not in "".join(p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file())


def test_config_or_shard_linked_outside_the_source_is_refused(source, tmp_path, capsys):
    import shutil

    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(source / "config.json", outside / "config.json")
    (source / "config.json").symlink_to(outside / "config.json")
    code = _run_cli(["convert", str(source), str(tmp_path / "out"), "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3 and "config.json is a symbolic link to" in err and "outside the source" in err
    (source / "config.json").unlink()
    shutil.move(outside / "config.json", source / "config.json")
    shard = sorted(source.glob("model-*.safetensors"))[0]
    shutil.move(shard, outside / shard.name)
    shard.symlink_to("/dev/zero")
    code = _run_cli(["convert", str(source), str(tmp_path / "out"), "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3 and f"{shard.name}: shard is a symbolic link to /dev/zero" in err
    assert not (tmp_path / "out").exists()


def test_a_hub_snapshot_of_links_into_blobs_converts(source, tmp_path, monkeypatch):
    """huggingface_hub's cache: snapshots/REV/NAME -> ../../blobs/HASH. Those links stay inside the repo's tree."""
    import hashlib
    import os

    import huggingface_hub

    repo = tmp_path / "hub" / "models--moonshotai--Kimi-K2.6"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.write_bytes(path.read_bytes())
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(snapshot))
    out = tmp_path / "out"
    summary = convert_checkpoint("moonshotai/Kimi-K2.6", out, method="amax", device="cpu", progress=False,
                                 record_stats=False)
    assert summary.skipped_files == [] and summary.shards_converted == 5
    assert (out / "tokenizer_config.json").read_bytes() == (source / "tokenizer_config.json").read_bytes()
    assert not (out / "tokenizer_config.json").is_symlink()


# --- determinism ------------------------------------------------------------------------------------------------


def test_manifest_bytes_do_not_depend_on_which_job_finishes_first(source, tmp_path, monkeypatch):
    import time

    from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME
    from kimi_nvfp4.convert import api

    real_job = api.run_shard_job
    files = sorted(p.name for p in source.glob("model-*.safetensors"))

    def run(out, slowest_first: bool):
        order = files if slowest_first else files[::-1]

        def delayed(job, *args, **kwargs):
            time.sleep(0.3 * (len(order) - order.index(job.file)))  # finish in the opposite of `order`
            return real_job(job, *args, **kwargs)

        monkeypatch.setattr(api, "run_shard_job", delayed)
        convert_checkpoint(source, out, method="amax", device="cpu", workers=5, progress=False)
        return (out / MANIFEST_NAME).read_bytes()

    a, b = run(tmp_path / "a", True), run(tmp_path / "b", False)
    assert list(json.loads(a)["shards"]) == files
    assert a == b
