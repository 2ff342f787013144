"""kimi_parsers against SGLang 0.5.23's kimi_k2 parsers, written as test vectors.

Each vector is what SGLang 0.5.23 returns for the text (checked by running the detectors of the
sglang==0.5.23 wheel: `KimiK2Detector().detect_and_parse(text, tools)` and
`ReasoningParser("kimi_k2", force_reasoning=...).parse_non_stream(text)`); the comment names the
source lines that decide it.
"""

import json

import pytest

from kimi_nvfp4.serve_check.kimi_parsers import (StreamSplitter, history_tool_calls, parse_tool_calls,
                                                 reasoning_forced, split_reasoning)

SGLANG = "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt"
REASONING_IMPL = f"{SGLANG}/parser/reasoning_parser.py#L163-L204"  # BaseReasoningFormatDetector._detect_and_parse_impl
KIMI_REASONING = f"{SGLANG}/parser/reasoning_parser.py#L516-L557"  # KimiK2Detector: tool_start_token = section begin
TOOL_REGEX = f"{SGLANG}/function_call/kimik2_detector.py#L71-L74"  # DOTALL; id [^\s<|]+; args \{.*?\}
ID_REGEX = f"{SGLANG}/function_call/kimik2_detector.py#L85-L89"  # (functions.)?NAME:N, bare counter N
NAME_RESOLUTION = f"{SGLANG}/function_call/kimik2_detector.py#L91-L158"  # _parse_tool_call_id, _infer_tool_name
DETECT_AND_PARSE = f"{SGLANG}/function_call/kimik2_detector.py#L164-L210"
CALL_ID = f"{SGLANG}/entrypoints/openai/serving_chat.py#L3129-L3148"  # functions.NAME:(history + position)
HISTORY = f"{SGLANG}/entrypoints/openai/serving_chat.py#L3335-L3353"
FORCED = f"{SGLANG}/entrypoints/openai/serving_chat.py#L3518-L3569"  # kimi_k2: thinking unless thinking=false

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(call_id: str, args: str) -> str:
    return f"{CB}{call_id}{AB}{args}{CE}"


READ_FILE = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
GREP = {"type": "function", "function": {"name": "grep", "parameters": {
    "type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}}}}}
UNION = {"type": "function", "function": {"name": "edit", "parameters": {
    "anyOf": [{"properties": {"patch": {"type": "string"}}}, {"properties": {"diff": {"type": "string"}}}]}}}

GREP_CALL = call("functions.grep:0", "{}")
PATH_ARGS = '{"path": "a.py"}'
NEWLINE_ARGS = '{"pattern": "a\nb"}'

# (id, text, force_reasoning, reasoning, content) -- REASONING_IMPL, KIMI_REASONING
REASONING_VECTORS = [
    ("forced, closed", "let me see</think>Done.", True, "let me see", "Done."),
    ("newlines after </think> are kept", "<think>hmm</think>\n\nAnswer", True, "hmm", "\n\nAnswer"),
    ("leading <think> tags dropped", "<think><think>a</think>b", True, "a", "b"),
    ("only the first </think> splits", "a</think>b</think>c", True, "a", "b</think>c"),
    ("still thinking when it stopped", "thinking without end", True, "thinking without end", ""),
    ("section before </think> ends the reasoning", "plan" + SB + GREP_CALL + SE, True, "plan", SB + GREP_CALL + SE),
    ("section anywhere, not only at a line start", "a" + SB + "x", True, "a", SB + "x"),
    ("</think> wins over an earlier section", "a" + SB + "b</think>c", True, "a" + SB + "b", "c"),
    ("not forced, no <think>: all content", "plain answer", False, "", "plain answer"),
    ("not forced, <think> inside: reasoning to </think>", "Hi <think>x</think> y", False, "Hi <think>x", " y"),
    ("not forced, <think> without end", "<think>abc", False, "abc", ""),
    ("empty", "", True, "", ""),
]


@pytest.mark.parametrize("text, forced, reasoning, content", [v[1:] for v in REASONING_VECTORS],
                         ids=[v[0] for v in REASONING_VECTORS])
def test_reasoning_vectors(text, forced, reasoning, content):
    assert split_reasoning(text, force_reasoning=forced) == (reasoning, content)


def test_force_nonempty_content_swaps_when_the_content_is_empty():
    # BaseReasoningFormatDetector._maybe_apply_force_nonempty_content (reasoning_parser.py#L126-L131)
    assert split_reasoning("only thoughts", force_nonempty_content=True) == ("", "only thoughts")
    assert split_reasoning("a</think>b", force_nonempty_content=True) == ("a", "b")


@pytest.mark.parametrize("kwargs, forced", [({}, True), ({"thinking": True}, True), ({"thinking": False}, False),
                                            ({"thinking": None}, True)])
def test_reasoning_is_forced_unless_thinking_is_off(kwargs, forced):
    assert reasoning_forced(kwargs) is forced  # FORCED


# (id, text, tools, content, [(name, arguments)]) -- TOOL_REGEX, ID_REGEX, NAME_RESOLUTION, DETECT_AND_PARSE
TOOL_VECTORS = [
    ("no section: all content", "x" + GREP_CALL, [GREP], "x" + GREP_CALL, []),
    ("two calls, content before the section",
     "Look." + SB + call("functions.read_file:0", PATH_ARGS)
     + CB + " functions.grep:1 " + AB + ' {"pattern": "x{2}"} ' + CE + SE, [READ_FILE, GREP], "Look.",
     [("read_file", PATH_ARGS), ("grep", '{"pattern": "x{2}"}')]),
    ("raw newline in the arguments (DOTALL in 0.5.23)", SB + call("functions.grep:0", NEWLINE_ARGS) + SE, [GREP], "",
     [("grep", NEWLINE_ARGS)]),
    ("newlines around id and arguments", SB + CB + "\nfunctions.grep:0\n" + AB + '\n{"a": 1}\n' + CE + SE, [GREP],
     "", [("grep", '{"a": 1}')]),
    ("id without functions. prefix", SB + call("search:3", "{}") + SE, [GREP], "", [("search", "{}")]),
    ("dotted and dashed names", SB + call("functions.fs.read-all:0", "{}") + SE, [GREP], "", [("fs.read-all", "{}")]),
    ("bare counter, one tool declared", SB + call("7", '{"x": 1}') + SE, [GREP], "", [("grep", '{"x": 1}')]),
    ("bare counter, best schema match", SB + call("2", '{"pattern": "p"}') + SE, [READ_FILE, GREP], "",
     [("grep", '{"pattern": "p"}')]),
    ("bare counter, a tie goes to the first declared", SB + call("2", '{"path": "a"}') + SE, [GREP, READ_FILE], "",
     [("grep", '{"path": "a"}')]),
    ("bare counter, union schema", SB + call("0", '{"diff": "d"}') + SE, [READ_FILE, UNION], "",
     [("edit", '{"diff": "d"}')]),
    ("bare counter, arguments not JSON: skipped", SB + call("0", "{bad}") + SE, [GREP, READ_FILE], "", []),
    ("malformed id skipped, later call kept", SB + call("bad:id:x", "{}") + call("functions.grep:1", "{}") + SE,
     [GREP], "", [("grep", "{}")]),
    ("arguments are brace text, not checked as JSON", SB + call("functions.grep:0", "{not json}") + SE, [GREP], "",
     [("grep", "{not json}")]),
    ("arguments must be an object", SB + call("functions.grep:0", "[1, 2]") + SE, [GREP], "", []),
    ("section without a complete call: dropped", "Hmm" + SB + CB + "functions.grep:0" + AB + '{"a"', [GREP], "Hmm",
     []),
    ("calls before the section count too", GREP_CALL + "text" + SB + SE, [GREP], GREP_CALL + "text",
     [("grep", "{}")]),
    ("text after the section is dropped", "a" + SB + GREP_CALL + SE + "tail", [GREP], "a", [("grep", "{}")]),
]


@pytest.mark.parametrize("text, tools, content, calls", [v[1:] for v in TOOL_VECTORS], ids=[v[0] for v in TOOL_VECTORS])
def test_tool_call_vectors(text, tools, content, calls):
    got_content, got = parse_tool_calls(text, tools)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls


def test_call_ids_count_the_history_not_the_model_suffix():
    # CALL_ID, HISTORY: the model's ":5" is ignored; two calls already in the history
    _, (first, second) = parse_tool_calls(SB + call("functions.grep:5", "{}") + call("functions.grep:9", "{}"),
                                          [GREP])
    history = [{"role": "assistant", "tool_calls": [{}, {}]}, {"role": "tool"}, {"role": "user"}]
    n = history_tool_calls(history)
    assert n == 2
    assert first.to_openai(0, n) == {"index": 0, "id": "functions.grep:2", "type": "function",
                                     "function": {"name": "grep", "arguments": "{}"}}
    assert second.to_openai(1, n)["id"] == "functions.grep:3"


def _stream(splitter: StreamSplitter, pieces: list[str]) -> tuple[str, str, list]:
    reasoning, content = "", ""
    for p in pieces:
        r, c = splitter.feed(p)
        reasoning += r
        content += c
    r, c, calls = splitter.finish()
    return reasoning + r, content + c, calls


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


STREAM_CASES = [v[1] for v in REASONING_VECTORS] + [
    "plan</think>\nLook." + SB + call("functions.read_file:0", PATH_ARGS) + SE,
    "still" + SB + call("functions.grep:0", NEWLINE_ARGS) + SE,
]


@pytest.mark.parametrize("text", STREAM_CASES)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_parse(text, size):
    splitter = StreamSplitter(force_reasoning=True, tools=[READ_FILE, GREP])
    reasoning, content, calls = _stream(splitter, _pieces(text, size))
    want_reasoning, rest = split_reasoning(text)
    want_content, want_calls = parse_tool_calls(rest, [READ_FILE, GREP])
    assert (reasoning, content) == (want_reasoning, want_content)
    assert calls == want_calls


def test_stream_splitter_without_tools_keeps_the_section_as_text():
    s = StreamSplitter(force_reasoning=False, parse_tools=False)
    text = "Look." + SB + GREP_CALL + SE
    reasoning, content, calls = _stream(s, _pieces(text, 5))
    assert calls == [] and reasoning == "" and content == text


def test_arguments_survive_as_generated():
    args = '{"path":  "a.py" ,"n": 1}'
    _, (c,) = parse_tool_calls(SB + call("functions.read_file:0", args) + SE, [READ_FILE])
    assert c.arguments == args and json.loads(c.arguments) == {"path": "a.py", "n": 1}
