"""Conversation validation and the loaders: JSONL, datasets, --data specs; bad input is counted or refused."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kimi_nvfp4.data.conversations import Conversation, Message
from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.data.loaders import (
    load_data_spec,
    load_hf_dataset,
    load_jsonl,
    resolve_data_spec,
    sample_sessions_path,
    save_jsonl,
)
from kimi_nvfp4.errors import KimiNvfp4Error


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_conversation_id_is_a_stable_content_hash(tool_call_record):
    a = Conversation.model_validate(tool_call_record)
    b = Conversation.model_validate(json.loads(json.dumps(tool_call_record)))
    assert a.id == b.id and len(a.id) == 16
    changed = json.loads(json.dumps(tool_call_record))
    changed["messages"][1]["content"] += "!"
    assert Conversation.model_validate(changed).id != a.id
    assert Conversation.model_validate({**tool_call_record, "id": "given"}).id == "given"


def test_message_normalises_openai_variants():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    m = Message.model_validate({"role": "assistant", "content": parts,
                                "thinking": "hmm", "refusal": None,
                                "tool_calls": [{"id": "functions.f:0", "type": "function",
                                                "function": {"name": "f", "arguments": {"x": 1}}}]})
    assert m.content == "ab" and m.reasoning_content == "hmm"
    assert json.loads(m.tool_calls[0].function.arguments) == {"x": 1}


@pytest.mark.parametrize("message, match", [
    ({"role": "robot", "content": "x"}, "role"),
    ({"role": "tool", "content": "x"}, "tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "a"}, "only valid on tool"),
    ({"role": "assistant"}, "content or tool_calls"),
    ({"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{bad"}}]}, "JSON"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "text content"),
    ({"role": "user", "content": "x", "surprise": 1}, "surprise"),
])
def test_invalid_messages_say_why(message, match):
    with pytest.raises(ValidationError, match=match):
        Message.model_validate(message)


def test_tool_result_must_answer_an_earlier_call():
    with pytest.raises(ValidationError, match="answers no earlier tool call"):
        Conversation.model_validate({"messages": [{"role": "user", "content": "x"},
                                                  {"role": "tool", "tool_call_id": "nope", "content": "y"}]})


def test_load_jsonl_skips_and_counts_bad_lines(tmp_path, tool_call_record):
    good = json.dumps(tool_call_record)
    path = _write_lines(tmp_path / "s.jsonl", [
        good,
        "",
        "{not json",
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}),
        json.dumps({"text": "no messages"}),
        json.dumps({"messages": [{"role": "user", "content": "second"}]}),
    ])
    result = load_jsonl(path)
    assert len(result.conversations) == 2
    assert result.skipped == 4
    assert [e.split(":")[1] for e in result.errors] == ["2", "3", "4", "5"]
    assert "empty line" in result.errors[0] and "malformed JSON" in result.errors[1]
    assert "role" in result.errors[2]


def test_load_jsonl_nothing_usable_is_an_error(tmp_path):
    path = _write_lines(tmp_path / "bad.jsonl", ["", "[1, 2]", json.dumps({"messages": [{"role": "x"}]})])
    with pytest.raises(DataError, match=r"bad.jsonl: no usable conversations \(3 records skipped") as info:
        load_jsonl(path)
    assert isinstance(info.value, KimiNvfp4Error) and info.value.exit_code == 9  # bad data


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_save_then_load_round_trips(tmp_path, tool_call_record):
    convs = [Conversation.model_validate(tool_call_record),
             Conversation.model_validate({"messages": [{"role": "user", "content": "hi"}]})]
    out = save_jsonl(convs, tmp_path / "out" / "x.jsonl")
    assert not list(out.parent.glob(".*partial"))
    loaded = load_jsonl(out).conversations
    assert [c.id for c in loaded] == [c.id for c in convs]
    assert loaded[0] == convs[0]


def test_hf_dataset_from_local_json_file(tmp_path, tool_call_record):
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(tool_call_record),
                                              json.dumps({"messages": [{"role": "user", "content": "plain"}]})])
    result = load_hf_dataset(str(path), "train")
    # Arrow fills absent fields with null; they must not break validation
    assert len(result.conversations) == 2 and result.skipped == 0
    assert result.conversations[0].id == Conversation.model_validate(tool_call_record).id


def test_hf_dataset_saved_to_disk_with_sharegpt_rows(tmp_path):
    import datasets

    rows = {"conversations": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
                              [{"from": "alien", "value": "?"}]]}
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "ds"))
    result = load_hf_dataset(str(tmp_path / "ds"), "test")
    assert len(result.conversations) == 1 and result.skipped == 1
    assert [m.role.value for m in result.conversations[0].messages] == ["user", "assistant"]
    with pytest.raises(DataError, match="no split 'nope'"):
        load_hf_dataset(str(tmp_path / "ds"), "nope")


def test_data_spec_combines_sources_and_dedupes(tmp_path, tool_call_record):
    a = _write_lines(tmp_path / "a.jsonl", [json.dumps(tool_call_record)])
    b = _write_lines(tmp_path / "b.jsonl", [json.dumps(tool_call_record),
                                            json.dumps({"messages": [{"role": "user", "content": "other"}]})])
    convs = resolve_data_spec(f"jsonl:{a}, {b}, hf:{b}:train")
    assert len(convs) == 2
    results = load_data_spec(f"jsonl:{a},{b}")
    assert [len(r.conversations) for r in results] == [1, 2]


@pytest.mark.parametrize("spec, expected", [("", "sglang-dump:DIR"), ("csv:x", "sglang-dump:DIR"),
                                            ("jsonl:", "jsonl:PATH"), ("tree", "tree:PATH"),
                                            ("builtin:x", "expected builtin")])
def test_bad_data_spec_is_refused(spec, expected):
    with pytest.raises(DataError, match=expected):
        resolve_data_spec(spec)


def test_shipped_sample_sessions_load_cleanly():
    result = load_jsonl(sample_sessions_path())
    assert result.skipped == 0 and len(result.conversations) >= 4
    assert all(c.tools and c.num_tool_calls >= 2 for c in result.conversations)
    assert resolve_data_spec("sample")[0].id == result.conversations[0].id
