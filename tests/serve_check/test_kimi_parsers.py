import json

from kimi_nvfp4.serve_check.kimi_parsers import StreamSplitter, parse_tool_calls, split_reasoning

TWO_CALLS = (
    "Let me look.<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{\"path\": \"a.py\"}<|tool_call_end|>"
    "<|tool_call_begin|> functions.grep:1 <|tool_call_argument_begin|> {\"pattern\": \"x{2}\"} <|tool_call_end|>"
    "<|tool_calls_section_end|>"
)


def test_two_calls_and_content_before_the_section():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me look."
    assert [(c.id, c.name, c.index) for c in calls] == [("functions.read_file:0", "read_file", 0),
                                                       ("functions.grep:1", "grep", 1)]
    assert json.loads(calls[0].arguments) == {"path": "a.py"}
    assert calls[1].to_openai(1) == {"index": 1, "id": "functions.grep:1", "type": "function",
                                     "function": {"name": "grep", "arguments": "{\"pattern\": \"x{2}\"}"}}


def test_no_section_is_all_content_and_bad_ids_are_skipped():
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>bad id<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_call_begin|>search:3<|tool_call_argument_begin|>{}<|tool_call_end|>")
    content, calls = parse_tool_calls(text)
    assert content == "" and [(c.name, c.index) for c in calls] == [("search", 3)]


def test_reasoning_split():
    assert split_reasoning("<think>hmm</think>\nAnswer") == ("hmm", "Answer")
    assert split_reasoning("still thinking", in_reasoning=True) == ("still thinking", "")
    assert split_reasoning("no think") == ("", "no think")


def test_stream_splitter_holds_back_partial_markers_and_emits_calls_at_the_end():
    s = StreamSplitter()
    pieces = ["<think>a", "b</thi", "nk>Hi ", "there<|tool_calls_sec", TWO_CALLS[len("Let me look.<|tool_calls_sec"):]]
    reasoning, content = "", ""
    for p in pieces:
        r, c = s.feed(p)
        reasoning += r
        content += c
    r, c, calls = s.finish()
    reasoning += r
    content += c
    assert reasoning == "ab"
    assert content == "Hi there"
    assert [c.name for c in calls] == ["read_file", "grep"]


def test_stream_splitter_without_tools_keeps_the_section_as_text():
    s = StreamSplitter(parse_tools=False)
    _, c1 = s.feed(TWO_CALLS[:20])
    r, c2, calls = s.finish()
    assert calls == [] and c1 + c2 == TWO_CALLS[:20]
