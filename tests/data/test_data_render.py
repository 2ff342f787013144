"""Served requests, their distinct windows (truncation, stats, exclusion) and split_heldout."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.data.conversations import Conversation
from kimi_nvfp4.data.loaders import load_jsonl, sample_sessions_path
from kimi_nvfp4.data.render import (
    MIN_TAIL_WINDOW_TOKENS,
    render_conversation,
    render_sessions,
    render_sessions_with_stats,
    served_requests,
    split_heldout,
)


def _conv(text: str) -> Conversation:
    return Conversation.model_validate({"messages": [{"role": "user", "content": text},
                                                     {"role": "assistant", "content": "ok"}]})


def _text(tok, ids) -> str:
    return tok.decode([int(i) for i in ids])


def test_a_finished_session_rendered_whole_keeps_no_reasoning(kimi_tokenizer, tool_call_record):
    """Kimi's history rule: everything up to the final answer is history, so no turn's reasoning stays."""
    conv = Conversation.model_validate(tool_call_record)
    text = _text(kimi_tokenizer, render_conversation(conv, kimi_tokenizer))
    assert "Search first." not in text and "Done." not in text
    assert text.count("<think></think>") == 2


def test_served_requests_are_prompt_then_the_completion_with_its_reasoning(kimi_tokenizer, tool_call_record):
    conv = Conversation.model_validate(tool_call_record)
    first, second = served_requests(conv, kimi_tokenizer)
    prompt1 = _text(kimi_tokenizer, first.prompt)
    assert prompt1.endswith("<|im_user|>user<|im_middle|>Where is scanstring used?<|im_end|>"
                            "<|im_assistant|>assistant<|im_middle|><think>")
    # the generation prompt opened <think>: the completion starts inside it, and ends before <|im_end|>
    assert _text(kimi_tokenizer, first.completion) == (
        "Search first.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.grep:0"
        '<|tool_call_argument_begin|>{"pattern": "scanstring"}<|tool_call_end|><|tool_calls_section_end|>')
    # inside the tool loop the template keeps the loop's reasoning: request 1 is a prefix of request 2
    assert second.prompt[:len(first.tokens)] == first.tokens
    prompt2 = _text(kimi_tokenizer, second.prompt)
    assert "<|im_system|>grep<|im_middle|>## Return of functions.grep:0\n" in prompt2  # a named tool result
    assert _text(kimi_tokenizer, second.completion) == "Done.</think>It is bound at json/decoder.py:130."


def test_preserve_thinking_keeps_finished_turns_reasoning_in_later_prompts(kimi_tokenizer):
    conv = Conversation.model_validate({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "old"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "new"}]})
    _, second = served_requests(conv, kimi_tokenizer)
    assert "<think></think>b" in _text(kimi_tokenizer, second.prompt)
    _, kept = served_requests(conv, kimi_tokenizer, preserve_thinking=True)
    assert "<think>old</think>b" in _text(kimi_tokenizer, kept.prompt)


def test_without_thinking_the_completion_is_the_answer(kimi_tokenizer):
    conv = Conversation.model_validate({"messages": [{"role": "user", "content": "a"},
                                                     {"role": "assistant", "content": "b"}]})
    (req,) = served_requests(conv, kimi_tokenizer, thinking=False)
    assert _text(kimi_tokenizer, req.prompt).endswith("<think></think>") and _text(kimi_tokenizer, req.completion) == "b"


LONG = " ".join(f"word{i}" for i in range(400))  # not periodic: no two windows of it are equal


def test_long_requests_split_into_windows_ending_at_the_completion(kimi_tokenizer):
    conv = _conv(LONG)
    (req,) = served_requests(conv, kimi_tokenizer)
    full = req.tokens
    seq_len = 64
    result = render_sessions_with_stats([conv], kimi_tokenizer, seq_len)
    seqs = result.sequences
    assert all(s.numel() <= seq_len for s in seqs)
    kept = torch.cat(seqs).tolist()
    assert kept == full[len(full) - len(kept):]  # consecutive, in order, no overlap, ending at the end
    head = len(full) % seq_len
    expected_drop = head if 0 < head < MIN_TAIL_WINDOW_TOKENS else 0
    assert len(full) - len(kept) == expected_drop == result.stats.dropped_tokens
    assert result.stats.split == 1 and result.stats.truncated == 0 and result.stats.requests == 1
    assert result.stats.samples == len(seqs) and result.stats.tokens == len(kept)
    assert result.conversation_ids == [conv.id] * len(seqs)


def test_identical_windows_are_kept_once(kimi_tokenizer):
    """Periodic text gives equal windows; fed from position 0 they are the same sample."""
    result = render_sessions_with_stats([_conv("word " * 400)], kimi_tokenizer, 32)
    windows = [tuple(s.tolist()) for s in result.sequences]
    assert len(windows) == len(set(windows)) and result.stats.duplicate_windows > 0


def test_truncation_keeps_the_last_window_of_each_request(kimi_tokenizer):
    convs = [_conv(LONG), _conv("short")]
    result = render_sessions_with_stats(convs, kimi_tokenizer, 64, split_long=False)
    (long_req,) = served_requests(convs[0], kimi_tokenizer)
    assert result.sequences[0].tolist() == long_req.tokens[-64:]
    assert result.stats.truncated == 1 and result.stats.split == 0 and result.stats.samples == 2
    stats = result.stats.to_dict()
    assert stats["conversations"] == 2 and stats["mean_request_tokens"] > 0 and "request_lengths" not in stats


def test_each_turn_adds_only_what_the_server_computes(kimi_tokenizer, tool_call_record):
    conv = Conversation.model_validate(tool_call_record)
    first, second = served_requests(conv, kimi_tokenizer)
    result = render_sessions_with_stats([conv], kimi_tokenizer, 100_000)
    # one window per request, each ending at its completion; the second's new tokens start after the first
    assert [s.tolist() for s in result.sequences] == [first.tokens, second.tokens]
    assert result.stats.new_tokens == len(second.tokens)
    assert result.stats.to_dict()["cached_tokens"] == len(first.tokens)


def test_sessions_sharing_a_long_preamble_give_distinct_windows(kimi_tokenizer):
    """The tool declarations and system prompt every session repeats are windowed once."""
    system = {"role": "system", "content": "You are a coding agent. " * 60}
    convs = [Conversation.model_validate({"messages": [system, {"role": "user", "content": f"task {i}"},
                                                       {"role": "assistant", "content": f"done {i}"}]})
             for i in range(6)]
    first = served_requests(convs[0], kimi_tokenizer)[0].tokens
    assert all(served_requests(c, kimi_tokenizer)[0].tokens[:300] == first[:300] for c in convs)
    result = render_sessions_with_stats(convs, kimi_tokenizer, 64)
    windows = [tuple(s.tolist()) for s in result.sequences]
    assert len(windows) == len(set(windows))
    assert sum(w == tuple(first[:64]) for w in windows) <= 1
    again = render_sessions_with_stats(convs + [convs[0].model_copy(update={"id": "copy"})], kimi_tokenizer, 64)
    assert again.stats.samples == result.stats.samples  # a repeated session adds nothing


def test_excluded_sessions_windows_are_never_returned(kimi_tokenizer):
    system = {"role": "system", "content": "Shared system prompt. " * 40}
    convs = [Conversation.model_validate({"messages": [system, {"role": "user", "content": f"task {i}"},
                                                       {"role": "assistant", "content": "ok"}]})
             for i in range(8)]
    calibration, heldout = convs[:6], convs[6:]
    cal = {tuple(s.tolist()) for s in render_sessions(calibration, kimi_tokenizer, 32)}
    alone = [tuple(s.tolist()) for s in render_sessions(heldout, kimi_tokenizer, 32)]
    assert set(alone) & cal  # rendered on its own, the held-out part repeats the shared preamble
    held = [tuple(s.tolist()) for s in render_sessions(heldout, kimi_tokenizer, 32, exclude=calibration)]
    assert held and not set(held) & cal and len(held) == len(set(held))


def test_sample_sessions_render_with_both_tokenizer_kinds(kimi_tokenizer, hf_tokenizer):
    convs = load_jsonl(sample_sessions_path()).conversations[:2]
    for tok in (kimi_tokenizer, hf_tokenizer):
        result = render_sessions_with_stats(convs, tok, 512)
        assert result.stats.rendered_tokens > 1000 and result.stats.new_tokens < result.stats.rendered_tokens
        ids = torch.cat(result.sequences)
        assert int((ids == tok.special_ids["<|tool_call_begin|>"]).sum()) >= 4


def test_heldout_split_is_disjoint_deterministic_and_by_id():
    convs = [_conv(f"task {i}") for i in range(50)]
    cal, held = split_heldout(convs, 0.2, seed=0)
    assert len(held) == 10 and len(cal) == 40
    assert not {c.id for c in cal} & {c.id for c in held}
    # the same ids go to the same side whatever the input order
    cal2, held2 = split_heldout(list(reversed(convs)), 0.2, seed=0)
    assert {c.id for c in held2} == {c.id for c in held}
    # both parts keep input order
    assert [c.id for c in cal] == [c.id for c in convs if c.id not in {h.id for h in held}]
    # another seed gives another split
    assert {c.id for c in split_heldout(convs, 0.2, seed=1)[1]} != {c.id for c in held}


def test_a_sessions_side_does_not_depend_on_the_other_sessions():
    """calibrate and validate load different numbers of generated sessions; they must agree on each."""
    convs = [_conv(f"task {i}") for i in range(400)]
    _, held_all = split_heldout(convs, 0.2)
    for n in (10, 40, 160):
        _, held = split_heldout(convs[:n], 0.2)
        assert {c.id for c in held} == {c.id for c in held_all if c in convs[:n]}
    assert 0.15 < len(held_all) / len(convs) < 0.25


def test_heldout_split_is_stable_across_machines():
    # sha256 of content ids: these pinned answers must never change, so calibrate and validate
    # (maybe on different hosts, different Python builds) always agree on the split
    convs = [_conv(f"pinned {i}") for i in range(10)]
    assert convs[0].id == "21dbfdf0a97d2214"
    _, held = split_heldout(convs, 0.3, seed=0)
    assert [c.messages[0].content for c in held] == ["pinned 2", "pinned 5", "pinned 8"]


@pytest.mark.parametrize("n, fraction, expected", [(2, 0.2, 1), (5, 0.01, 1), (5, 0.99, 4), (1, 0.5, 0), (4, 0.0, 0),
                                                   (4, 1.0, 4)])
def test_heldout_split_sizes(n, fraction, expected):
    convs = [_conv(f"c{i}") for i in range(n)]
    cal, held = split_heldout(convs, fraction)
    assert len(held) == expected and len(cal) == n - expected


def test_duplicate_conversations_land_on_one_side():
    convs = [_conv("same"), _conv("same")] + [_conv(f"x{i}") for i in range(8)]
    cal, held = split_heldout(convs, 0.5)
    assert sum(c.id == convs[0].id for c in cal) in (0, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_heldout([], 1.5)
    with pytest.raises(ValueError, match="seq_len"):
        render_sessions([], None, 0)
