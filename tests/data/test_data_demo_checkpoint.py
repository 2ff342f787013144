"""The bundled tiny demo checkpoint's tokenizer files load and render through kimi_nvfp4.data."""

from __future__ import annotations

from pathlib import Path

from kimi_nvfp4.data.loaders import load_jsonl, sample_sessions_path
from kimi_nvfp4.data.render import render_sessions_with_stats
from kimi_nvfp4.data.tokenizer import load_tokenizer


def _demo_checkpoint() -> Path:
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    path = Path(DEMO_CHECKPOINT)
    # the tokenizer files ship with the package: their absence is a packaging bug, not a reason to skip
    assert (path / "tokenizer_config.json").is_file(), f"the bundled demo checkpoint lacks tokenizer files: {path}"
    return path


def test_demo_tokenizer_has_kimi_specials_in_its_top_block():
    tok = load_tokenizer(_demo_checkpoint())
    assert tok.kind == "tokenizers"
    block_start = tok.vocab_size - 256
    assert tok.special_ids["[BOS]"] == block_start and tok.special_ids["[PAD]"] == tok.vocab_size - 1
    assert tok.special_ids["<|im_end|>"] in tok.stop_ids and tok.eos_id == tok.special_ids["[EOS]"]


def test_sample_sessions_render_with_the_demo_template():
    tok = load_tokenizer(_demo_checkpoint())
    convs = load_jsonl(sample_sessions_path()).conversations[:2]
    result = render_sessions_with_stats(convs, tok, 256)
    ids = [int(i) for s in result.sequences for i in s]
    assert max(ids) < tok.vocab_size
    for token in ("<|im_user|>", "<|tool_call_begin|>", "<|im_end|>"):
        assert tok.special_ids[token] in ids
