"""`build_demo_model` end to end at toy scale, and the click command's surface."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.cli import cli, main
from kimi_nvfp4.demo_model.build import REPORT_FILE, build_demo_model
from kimi_nvfp4.demo_model.train import TrainSettings


def test_build_writes_a_readable_checkpoint_and_a_report(tmp_path, sample_source_root, tiny_tokenizer_dir, test_spec):
    out = tmp_path / "demo"
    settings = TrainSettings(steps=3, batch_size=2, seq_len=64, warmup_steps=1, eval_every=3, eval_windows=1,
                             chat_sessions=4)
    report = build_demo_model(out, settings=settings, spec=test_spec, source_root=sample_source_root,
                              tokenizer_dir=tiny_tokenizer_dir, heldout_fraction=0.3, heldout_chat_sessions=2,
                              progress=False, log=lambda _: None)
    reader = CheckpointReader(out)
    assert reader.layout.text.vocab_size == test_spec.vocab_size
    saved = json.loads((out / REPORT_FILE).read_text())
    assert saved["perplexity"] == report.perplexity
    assert set(saved["perplexity"]) == {"float32_code", "float32_chat", "int4_checkpoint_code", "int4_checkpoint_chat"}
    assert saved["train"]["settings"]["steps"] == 3 and saved["checkpoint_bytes"] > 0
    assert saved["corpus"]["heldout_files"] and all(not f.startswith("/") for f in saved["corpus"]["heldout_files"])


def test_help_lists_the_options():
    result = CliRunner().invoke(cli, ["build-demo-model", "--help"])
    assert result.exit_code == 0
    for option in ("--device", "--steps", "--seed", "--source-root", "--tokenizer-dir", "--time-budget-s"):
        assert option in result.output


def test_cuda_without_a_gpu_exits_with_the_device_error_code(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(["build-demo-model", str(tmp_path / "x"), "--device", "cuda"])
    assert exc.value.code == 5
