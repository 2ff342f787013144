"""Bad input gets a one-line error naming what was expected, and nothing is written."""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.checkpoint.output_lock import LOCK_NAME
import torch

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.checkpoint.writer import ShardWriter, write_index
from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.errors import CheckpointError, UnsupportedCheckpointError
from kimi_nvfp4.synth import create_synthetic_checkpoint


def _snapshot(folder):
    # The folder's lock file records each holder (pid, start time): bookkeeping, not checkpoint content.
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.name != LOCK_NAME}


def _run(out, src, data, **kw):
    return calibrate_checkpoint(out, src, data, samples=2, seq_len=48, device="cpu", progress=False, **kw)


def test_not_converted_checkpoint_is_refused(converted_pair):
    src, _out = converted_pair
    before = _snapshot(src)
    with pytest.raises(UnsupportedCheckpointError, match="not a converted NVFP4 checkpoint"):
        _run(src, src, "sample")
    assert _snapshot(src) == before


def test_source_that_does_not_match_is_refused(converted_pair, tmp_path):
    _src, out = converted_pair
    other = create_synthetic_checkpoint(tmp_path / "other", preset="tiny", seed=7)
    before = _snapshot(out)
    with pytest.raises(CheckpointError, match="source does not match the converted checkpoint"):
        _run(out, other, "sample")
    assert _snapshot(out) == before


def test_source_with_other_dimensions_is_refused(converted_pair, tmp_path):
    _src, out = converted_pair
    other = create_synthetic_checkpoint(tmp_path / "other", preset="tiny", layers=2)
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        _run(out, other, "sample")


def test_converted_output_given_as_source_is_refused(converted_pair):
    _src, out = converted_pair
    with pytest.raises(UnsupportedCheckpointError, match="SOURCE must be the INT4 checkpoint"):
        _run(out, out, "sample")


def test_incomplete_conversion_is_refused(converted_pair):
    src, out = converted_pair
    manifest = json.loads((out / "kimi_nvfp4_manifest.json").read_text())
    manifest["complete"] = False
    (out / "kimi_nvfp4_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="did not finish"):
        _run(out, src, "sample")


def test_malformed_lines_are_skipped_and_counted(converted_pair, sessions_jsonl):
    src, out = converted_pair
    good = sessions_jsonl.read_text()
    bad_role = json.dumps({"messages": [{"role": "wizard", "content": "hi"}]})
    sessions_jsonl.write_text("\n" + "{not json\n" + bad_role + "\n" + good)
    # 3 bad of 15 records: over the 1% allowed (data/source_registry.py), refused before any layer
    with pytest.raises(DataError, match="3 of 15 records are unreadable"):
        _run(out, src, f"jsonl:{sessions_jsonl}")
    # under 1% (repeated sessions count as records read and are kept once): skipped and counted
    sessions_jsonl.write_text("\n" + "{not json\n" + bad_role + "\n" + good * 30)
    report = _run(out, src, f"jsonl:{sessions_jsonl}")
    assert report.records_skipped == 3
    assert any("malformed JSON" in r for r in report.skip_reasons)
    assert any("wizard" in r or "role" in r for r in report.skip_reasons)


def test_nothing_usable_is_an_error_and_writes_nothing(converted_pair, tmp_path):
    src, out = converted_pair
    junk = tmp_path / "junk.jsonl"
    junk.write_text("\n{oops\n" + json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    before = _snapshot(out)
    with pytest.raises(DataError, match="no usable conversations"):
        _run(out, src, f"jsonl:{junk}")
    assert _snapshot(out) == before


def test_long_sessions_are_split_to_seq_len(converted_pair, sessions_jsonl):
    src, out = converted_pair
    report = calibrate_checkpoint(
        out, src, f"jsonl:{sessions_jsonl}", samples=64, seq_len=16, device="cpu", progress=False
    )
    assert report.sequences > report.conversations  # sessions longer than 16 tokens became several windows
    assert report.tokens <= report.sequences * 16


def test_input_scales_in_main_shards_are_refused(converted_pair):
    """A main shard already holding an input_scale cannot get a second copy in the calibration shard."""
    src, out = converted_pair
    reader = CheckpointReader(out)
    scale_2 = next(n for n in reader.weight_map if n.endswith(".weight_scale_2"))
    name = scale_2.replace(".weight_scale_2", ".input_scale")
    file = reader.weight_map[scale_2]
    writer = ShardWriter(out / file)
    for n in reader.shard_tensors(file):
        writer.add(n, reader.load(n))
    writer.add(name, reader.load(scale_2))
    reader.close()
    writer.commit()
    write_index(out, dict(reader.weight_map, **{name: file}), 0)
    with pytest.raises(CheckpointError, match="already live in the main shards"):
        _run(out, src, "sample")
    assert not (out / "model-input-scales.safetensors").exists()


def _exit_code(argv: list[str]) -> int:
    from kimi_nvfp4.cli import main

    try:
        main(argv)
    except SystemExit as e:
        return int(e.code)
    return 0


def test_cli_runs_and_maps_errors_to_exit_codes(converted_pair, capsys):
    src, out = converted_pair
    common = ["--data", "sample", "--samples", "2", "--seq-len", "32", "--device", "cpu", "--no-progress"]
    assert _exit_code(["calibrate", str(out), "--source", str(src), *common]) == 0
    assert "calibrated" in capsys.readouterr().out
    assert _exit_code(["calibrate", str(src), "--source", str(src), *common]) == 3
    assert "not a converted NVFP4 checkpoint" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert _exit_code(["calibrate", str(out), "--source", str(src), *common, "--device", "cuda"]) == 5
