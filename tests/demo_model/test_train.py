"""Training loop: schedule, data stream, reproducibility, routing balance, learning."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.demo_model.corpus import SourceFile
from kimi_nvfp4.demo_model.specials import EOS_TOKEN
from kimi_nvfp4.demo_model.tokenizer_build import load_tokenizer_json
from kimi_nvfp4.demo_model.train import TrainSettings, build_train_stream, lr_at, mean_nll, train_model

TINY_TRAIN = TrainSettings(steps=4, batch_size=2, seq_len=32, warmup_steps=2, eval_every=2, eval_windows=2,
                           chat_sessions=0, bias_update_speed=1e-2)
FILES = (SourceFile("a.py", "def add(a, b):\n    return a + b\n" * 20),
         SourceFile("pkg/b.py", "class Box:\n    def get(self):\n        return self.value\n" * 20))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    s = TrainSettings(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, s) == pytest.approx(0.1) and lr_at(9, s) == pytest.approx(1.0)
    assert lr_at(10, s) == pytest.approx(1.0)
    assert lr_at(99, s) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(i, s) >= lr_at(i + 1, s) for i in range(10, 99))


def test_train_stream_has_every_document_once_with_eos_and_chats(tiny_tokenizer_dir, test_spec):
    tok = load_tokenizer_json(tiny_tokenizer_dir)
    stream, code, chat = build_train_stream(tok, FILES, test_spec, chat_sessions=3, seed=0)
    assert stream.numel() == code + chat and chat > 0
    assert int((stream == tok.token_to_id(EOS_TOKEN)).sum()) == len(FILES) + 3
    again, _, _ = build_train_stream(tok, FILES, test_spec, chat_sessions=3, seed=0)
    assert torch.equal(stream, again)


def _stream(tiny_tokenizer_dir, test_spec):
    tok = load_tokenizer_json(tiny_tokenizer_dir)
    return build_train_stream(tok, FILES, test_spec, chat_sessions=0, seed=0)[0]


def test_cpu_training_is_bit_reproducible(tiny_tokenizer_dir, test_spec):
    stream = _stream(tiny_tokenizer_dir, test_spec)
    a, log_a = train_model(test_spec, stream, TINY_TRAIN, progress=False, log=lambda _: None)
    b, log_b = train_model(test_spec, stream, TINY_TRAIN, progress=False, log=lambda _: None)
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(ta, tb), name
    assert log_a.losses == log_b.losses and log_a.tokens_seen == 4 * 2 * 32


def test_training_learns_and_moves_the_router_bias(tiny_tokenizer_dir, test_spec):
    stream = _stream(tiny_tokenizer_dir, test_spec)
    settings = TrainSettings(steps=30, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=3, eval_every=30,
                             chat_sessions=0, bias_update_speed=1e-2)
    before, _ = mean_nll(train_model(test_spec, stream, TrainSettings(**{**settings.to_dict(), "steps": 1}),
                                     progress=False, log=lambda _: None)[0], stream, 32, 8, "cpu")
    model, tlog = train_model(test_spec, stream, settings, heldout_stream=stream, progress=False, log=lambda _: None)
    after, _ = mean_nll(model, stream, 32, 8, "cpu")
    assert after < before - 1.0
    assert tlog.heldout_losses and tlog.heldout_losses[-1][1] == pytest.approx(after, rel=0.05)
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(biases) == test_spec.num_hidden_layers - 1 and all(float(b.abs().max()) > 0 for b in biases)


def test_mean_nll_needs_at_least_one_window(test_spec):
    with pytest.raises(ValueError, match="shorter than one window"):
        mean_nll(None, torch.zeros(10, dtype=torch.long), 32, 2, "cpu")
