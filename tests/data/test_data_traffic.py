"""Served-traffic importers: SGLang dumps and logs (ids as served), OpenAI/LiteLLM/Anthropic/OTel (re-rendered)."""

from __future__ import annotations

import json
import pickle

import pytest
from click.testing import CliRunner

from kimi_nvfp4.data.cli import data_command
from kimi_nvfp4.data.errors import DataError, TruncatedLogError, UnsafePickleError
from kimi_nvfp4.data.loaders import load_data_spec
from kimi_nvfp4.data.windows import split_windows

from .traffic_fixtures import entry, log_line, out_dict, write_dump, write_lines

SEQ_LEN = 4096  # longer than every fixture request: one window per request


def _windows(spec, tokenizer, seq_len=SEQ_LEN):
    w = split_windows(load_data_spec(spec), tokenizer, seq_len, heldout_fraction=0.5)
    return w, [s.tolist() for s in w.calibration.sequences], [s.tolist() for s in w.heldout.sequences]


def _session(tokenizer, user: str, turns: int, base: int = 1000) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) per turn of one agent session: turn k+1's prompt holds turn k's whole sequence."""
    sp = tokenizer.special_ids
    prompt = [sp["<|im_system|>"], 7, 8, sp["<|im_end|>"], sp["<|im_user|>"], *tokenizer.encode(user),
              sp["<|im_end|>"], sp["<|im_assistant|>"]]
    out = []
    for k in range(turns):
        output = [base + k, base + k + 1, sp["<|im_end|>"]]
        out.append((list(prompt), output))
        prompt = prompt + output + [sp["<|im_system|>"], base + 50 + k, sp["<|im_end|>"], sp["<|im_assistant|>"]]
    return out


def test_sglang_dump_windows_are_the_served_ids(tmp_path, kimi_tokenizer):
    a = _session(kimi_tokenizer, "fix the parser", 3)
    b = _session(kimi_tokenizer, "explain scanstring", 2, base=2000)
    entries = [entry(p, o, t=i) for i, (p, o) in enumerate(a + b)]
    aborted = entry([5, 6, 7, 8], [9, 9], finish="abort", t=10)
    write_dump(tmp_path / "dumps" / "2026-01-01_12-00-00.pkl", entries[:3])
    write_dump(tmp_path / "dumps" / "2026-01-01_12-05-00.pkl", entries[3:], bare=True)  # the older bare list
    write_dump(tmp_path / "dumps" / "host-a" / "crash_dump_2026-01-01_12-09-00.pkl", [aborted], crash=True)
    w, cal, held = _windows(f"sglang-dump:{tmp_path / 'dumps'}", kimi_tokenizer)
    expected = [p + o for p, o in a + b] + [[5, 6, 7, 8]]  # an aborted request: its prompt, never its output
    assert sorted(cal + held) == sorted(expected)
    # split by conversation: a session's requests all land on one side
    for session in (a, b):
        sides = {("cal" if p + o in cal else "held") for p, o in session}
        assert len(sides) == 1
    assert w.calibration_groups + w.heldout_groups == 3
    # turn k+1 repeats turn k: the radix tree counts the shared prefix once
    assert 0 < w.unique_token_fraction < 0.7


def test_a_window_never_glues_two_requests(tmp_path, kimi_tokenizer):
    a = _session(kimi_tokenizer, "short", 3)
    write_dump(tmp_path / "d" / "x.pkl", [entry(p, o, t=i) for i, (p, o) in enumerate(a)])
    _, cal, held = _windows(f"sglang-dump:{tmp_path / 'd'}", kimi_tokenizer, seq_len=8)
    sequences = [p + o for p, o in a]
    for window in cal + held:  # every window is a slice of one served sequence
        assert any(any(s[i:i + len(window)] == window for i in range(len(s))) for s in sequences)


def test_session_id_groups_requests_and_text_prompts_are_tokenized(tmp_path, kimi_tokenizer):
    text = "<|im_user|>user<|im_middle|>hello there<|im_end|><|im_assistant|>assistant<|im_middle|>"
    write_dump(tmp_path / "d" / "x.pkl", [entry(text=text, output_ids=[42, 43], t=0, session="s1"),
                                          entry([1, 2, 3], [4], t=1, session="s1")])
    w, cal, held = _windows(f"sglang-dump:{tmp_path / 'd'}", kimi_tokenizer)
    assert w.calibration_groups + w.heldout_groups == 1  # one session id, one conversation
    assert sorted(cal + held) == sorted([kimi_tokenizer.encode(text, allow_special=True) + [42, 43], [1, 2, 3, 4]])
    assert kimi_tokenizer.special_ids["<|im_user|>"] in (cal + held)[0] + (cal + held)[1]


def test_outputs_option_keeps_prompts_only(tmp_path, kimi_tokenizer):
    write_dump(tmp_path / "d" / "x.pkl", [entry([1, 2, 3], [4, 5])])
    _, cal, held = _windows(f"sglang-dump:{tmp_path / 'd'}?outputs=false", kimi_tokenizer)
    assert cal + held == [[1, 2, 3]]
    with pytest.raises(DataError, match="sglang-dump: option colour"):
        load_data_spec(f"sglang-dump:{tmp_path / 'd'}?colour=red")


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("payload", ["reduce", "eval", "numpy"])
def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path, payload):
    marker = tmp_path / "ran"
    folder = tmp_path / "dumps"
    folder.mkdir()
    if payload == "reduce":
        data = {"server_args": _RunsACommand(marker), "requests": []}
        blob = pickle.dumps(data)
        expect = "system"
    elif payload == "eval":
        # builtins.eval through REDUCE, written by hand (protocol 0): c builtins eval ( S'...' t R .
        blob = f"cbuiltins\neval\n(S'__import__(\"os\").system(\"touch {marker}\")'\ntR.".encode()
        expect = "builtins.eval"
    else:
        blob = b"cnumpy.core.multiarray\n_reconstruct\n(tR."
        expect = "numpy"
    (folder / "2026-01-01_00-00-00.pkl").write_bytes(blob)
    with pytest.raises(UnsafePickleError, match=rf"2026-01-01_00-00-00.pkl: refuses the global .*{expect}") as e:
        load_data_spec(f"sglang-dump:{folder}")
    assert e.value.exit_code == 9
    assert not marker.exists()


def test_unreadable_records_are_counted_and_too_many_fail_before_anything_runs(tmp_path, kimi_tokenizer):
    good = [entry([1, 2, 3, i], [4], t=i) for i in range(200)]
    bad = [("not", "an", "entry"), entry(None, [1])]  # a wrong tuple, a request with no prompt
    write_dump(tmp_path / "d" / "x.pkl", good + bad)
    result = load_data_spec(f"sglang-dump:{tmp_path / 'd'}")[0]
    assert (result.read, result.skipped, len(result.requests)) == (202, 2, 200)
    assert any("x.pkl:201: neither input_ids nor text" in e for e in result.errors)
    from kimi_nvfp4.data.source_registry import check_bad_fraction

    check_bad_fraction([result])  # 1% exactly: allowed
    write_dump(tmp_path / "e" / "y.pkl", good[:50] + bad)
    with pytest.raises(DataError, match=r"2 of 52 records are unreadable .* first: .*y.pkl:50"):
        check_bad_fraction(load_data_spec(f"sglang-dump:{tmp_path / 'e'}"))


def test_ids_outside_the_vocabulary_are_named_before_any_weights(tmp_path, kimi_tiktoken_dir):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(kimi_tiktoken_dir, ckpt)
    (ckpt / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 16384}}))
    write_dump(tmp_path / "d" / "x.pkl", [entry([1, 163587, 3], [163586], t=i) for i in range(4)])
    result = CliRunner().invoke(data_command, ["export", "--data", f"sglang-dump:{tmp_path / 'd'}", "--checkpoint",
                                               str(ckpt), "--out", str(tmp_path / "w.jsonl")])
    assert isinstance(result.exception, DataError) and result.exception.exit_code == 9
    assert "vocabulary of at least 163,588; this checkpoint has 16,384" in str(result.exception)
    assert not (tmp_path / "w.jsonl").exists()


def _request_log(path, obj_ids, level=3):
    obj = {"rid": "a", "text": None, "input_ids": obj_ids, "sampling_params": {}}
    if level <= 1:
        obj = {"rid": "a"}
    return write_lines(path, [log_line({**obj, "rid": "a"}, out_dict([7, 8]), event="request.received"),
                              log_line(obj, out_dict([7, 8])), "[2026-01-01 12:00:01] some other message"])


def test_sglang_log_level_3_is_read_as_served(tmp_path, kimi_tokenizer):
    _request_log(tmp_path / "logs" / "host_0.log", [1, 2, 3])
    _request_log(tmp_path / "logs" / "host_1.log.2026-01-01_11", [4, 5, 6])
    w, cal, held = _windows(f"sglang-log:{tmp_path / 'logs'}", kimi_tokenizer)
    assert sorted(cal + held) == [[1, 2, 3, 7, 8], [4, 5, 6, 7, 8]]


@pytest.mark.parametrize("level, ids, match", [(1, [1, 2], "no prompt .*--log-requests-level 0 or 1"),
                                               (2, [1] * 1024 + ["..."] + [2] * 1024, "input_ids was cut")])
def test_truncating_log_levels_are_refused(tmp_path, level, ids, match):
    path = _request_log(tmp_path / "logs" / "h_0.log", ids, level=level)
    with pytest.raises(TruncatedLogError, match=match) as e:
        load_data_spec(f"sglang-log:{tmp_path / 'logs'}")
    assert str(path) in str(e.value) and "line 2" in str(e.value)


# --- message-level logs: rendered with the checkpoint's template exactly as SGLang's chat endpoint would ---

TOOLS = [{"type": "function", "function": {"name": "grep", "description": "Search the repo.",
                                           "parameters": {"type": "object", "required": ["pattern"],
                                                          "properties": {"pattern": {"type": "string"}}}}}]
# The Kimi messages every fixture below maps to: a tool loop with reasoning, and its final reply.
KIMI_PROMPT = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Where is scanstring used?"},
    {"role": "assistant", "content": None, "reasoning_content": "Search first.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "grep", "arguments": "{\"pattern\": \"scanstring\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "json/decoder.py:130:scanstring = c_scanstring"},
]
KIMI_REPLY = {"role": "assistant", "content": "At json/decoder.py:130.", "reasoning_content": "Found it."}


def _expected_ids(tokenizer, prompt=KIMI_PROMPT, reply=KIMI_REPLY, tools=TOOLS, **kwargs):
    from kimi_nvfp4.data.conversations import Message
    from kimi_nvfp4.data.render import _without_prompt_owned, completion_text

    text = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, **kwargs)
    completion = _without_prompt_owned(text, completion_text(Message.model_validate(reply)))
    return tokenizer.encode(text, allow_special=True) + tokenizer.encode(completion, allow_special=True)


def _openai_body():
    return {"model": "kimi-k2.6", "messages": KIMI_PROMPT, "tools": TOOLS, "temperature": 1.0}


def _openai_response(finish="stop"):
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1760000000,
            "choices": [{"index": 0, "message": KIMI_REPLY, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5}}


def _anthropic_record():
    body = {"model": "kimi-k2.6", "max_tokens": 1024, "system": [{"type": "text", "text": "You are a coding agent."}],
            "tools": [{"name": "grep", "description": "Search the repo.",
                       "input_schema": TOOLS[0]["function"]["parameters"]}],
            "messages": [
                {"role": "user", "content": "Where is scanstring used?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Search first.", "signature": "sig"},
                    {"type": "tool_use", "id": "call_1", "name": "grep", "input": {"pattern": "scanstring"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1",
                     "content": [{"type": "text", "text": "json/decoder.py:130:scanstring = c_scanstring"}]}]}]}
    response = {"id": "msg_1", "type": "message", "role": "assistant", "stop_reason": "end_turn",
                "content": [{"type": "thinking", "thinking": "Found it.", "signature": "s"},
                            {"type": "text", "text": "At json/decoder.py:130."}]}
    return {"request": body, "response": response}


def _otel_span():
    def parts(*p):
        return list(p)
    inputs = [
        {"role": "user", "parts": parts({"type": "text", "content": "Where is scanstring used?"})},
        {"role": "assistant", "parts": parts({"type": "reasoning", "content": "Search first."},
                                             {"type": "tool_call", "id": "call_1", "name": "grep",
                                              "arguments": {"pattern": "scanstring"}})},
        {"role": "tool", "parts": parts({"type": "tool_call_response", "id": "call_1",
                                         "response": "json/decoder.py:130:scanstring = c_scanstring"})}]
    outputs = [{"role": "assistant", "finish_reason": "stop",
                "parts": parts({"type": "reasoning", "content": "Found it."},
                               {"type": "text", "content": "At json/decoder.py:130."})}]
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "kimi-k2.6",
             "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "You are a coding agent."}]),
             "gen_ai.input.messages": json.dumps(inputs), "gen_ai.output.messages": json.dumps(outputs),
             "gen_ai.tool.definitions": json.dumps([{"type": "function", **{k: v for k, v in
                                                                           TOOLS[0]["function"].items()}}]),
             "gen_ai.conversation.id": "conv-1"}
    otlp_attrs = [{"key": k, "value": {"stringValue": v}} for k, v in attrs.items()]
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {"name": "genai"}, "spans": [
        {"traceId": "t", "spanId": "s", "name": "chat kimi-k2.6", "startTimeUnixNano": "1760000000000000000",
         "attributes": otlp_attrs},
        {"traceId": "t", "spanId": "u", "name": "http", "attributes": []}]}]}]}


@pytest.mark.parametrize("kind, record", [
    ("openai", {"request": _openai_body(), "response": _openai_response()}),
    ("litellm", {"request_id": "x", "call_type": "acompletion", "startTime": "2026-01-01T12:00:00Z",
                 "messages": json.dumps(KIMI_PROMPT), "response": json.dumps(_openai_response()),
                 "proxy_server_request": json.dumps(_openai_body()), "session_id": "conv-1"}),
    ("anthropic", _anthropic_record()),
    ("otel", _otel_span()),
])
def test_message_logs_render_with_the_checkpoints_template(tmp_path, kimi_tokenizer, kind, record):
    path = write_lines(tmp_path / f"{kind}.jsonl", [record])
    _, cal, held = _windows(f"{kind}:{path}", kimi_tokenizer)
    assert cal + held == [_expected_ids(kimi_tokenizer)]


def test_an_unfinished_reply_is_not_appended_and_thinking_off_is_rendered(tmp_path, kimi_tokenizer):
    record = {"request": {**_openai_body(), "chat_template_kwargs": {"thinking": False}},
              "response": _openai_response(finish="abort")}
    path = write_lines(tmp_path / "o.jsonl", [record])
    _, cal, held = _windows(f"openai:{path}", kimi_tokenizer)
    text = kimi_tokenizer.apply_chat_template(KIMI_PROMPT, tools=TOOLS, add_generation_prompt=True, thinking=False)
    assert cal + held == [kimi_tokenizer.encode(text, allow_special=True)]
    assert text.endswith("<think></think>")


def test_anthropic_images_are_skipped_with_their_reason(tmp_path):
    bad = _anthropic_record()
    bad["request"]["messages"][0] = {"role": "user", "content": [{"type": "image", "source": {}}]}
    path = write_lines(tmp_path / "a.jsonl", [_anthropic_record(), bad, "{oops"])
    result = load_data_spec(f"anthropic:{path}")[0]
    assert (len(result.requests), result.skipped) == (1, 2)
    assert dict(result.skip_counts) == {"invalid request": 1, "malformed JSON": 1}
    assert any("a.jsonl:2" in e and "'image'" in e for e in result.errors)


def test_export_writes_exactly_the_windows(tmp_path, kimi_tiktoken_dir, kimi_tokenizer):
    a = _session(kimi_tokenizer, "fix the parser", 3)
    b = _session(kimi_tokenizer, "explain scanstring", 2, base=2000)
    write_dump(tmp_path / "d" / "x.pkl", [entry(p, o, t=i) for i, (p, o) in enumerate(a + b)])
    out = tmp_path / "w.jsonl"
    spec = f"sglang-dump:{tmp_path / 'd'}"
    result = CliRunner().invoke(data_command, ["export", "--data", spec, "--checkpoint", str(kimi_tiktoken_dir),
                                               "--seq-len", "4096", "--heldout-fraction", "0.5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    _, cal, held = _windows(spec, kimi_tokenizer)
    assert [r["ids"] for r in rows if r["split"] == "calibration"] == cal
    assert [r["ids"] for r in rows if r["split"] == "heldout"] == held
    stats = CliRunner().invoke(data_command, ["stats", "--data", spec, "--checkpoint", str(kimi_tiktoken_dir)])
    report = json.loads(stats.output)
    assert report["sources"][0]["records_read"] == 5 and report["sources"][0]["tokens"] == "as served"
    assert 0 < report["unique_token_fraction"] < 1
