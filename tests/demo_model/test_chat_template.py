"""The Kimi-style chat template: tool declarations, tool calls, tool results and thinking."""

from __future__ import annotations

import json

from kimi_nvfp4.demo_model.agent_chats import AGENT_TOOLS, agent_sessions
from kimi_nvfp4.demo_model.chat_template import DEFAULT_SYSTEM_PROMPT, render_chat
from kimi_nvfp4.demo_model.corpus import SourceFile
from kimi_nvfp4.demo_model.specials import special_id
from kimi_nvfp4.demo_model.tokenizer_build import load_tokenizer_json

CALL_ID = "functions.read_file:0"
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Show me a.py"},
    {"role": "assistant", "content": "", "reasoning_content": "I need the file.",
     "tool_calls": [{"id": CALL_ID, "type": "function",
                     "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "x = '<tag>'"},
    {"role": "assistant", "content": "It sets x."},
]


def _expected(reasoning: str) -> str:
    return (
        f"<|im_system|>tool_declare<|im_middle|>{json.dumps(AGENT_TOOLS, ensure_ascii=False)}<|im_end|>"
        "<|im_system|>system<|im_middle|>You are a coding agent.<|im_end|>"
        "<|im_user|>user<|im_middle|>Show me a.py<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>"
        '{"path": "a.py"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.read_file:0\nx = '<tag>'<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>It sets x.<|im_end|>"
    )


def test_tool_conversation_renders_kimi_turns_exactly():
    # a finished session is all history (K2-Thinking's rule): no reasoning is rendered
    assert render_chat(TOOL_CONVERSATION, AGENT_TOOLS) == _expected("")
    assert render_chat(TOOL_CONVERSATION, AGENT_TOOLS, preserve_thinking=True) == _expected("I need the file.")


def test_reasoning_of_the_running_tool_loop_is_kept():
    """Before the final answer the tool-call turn is after the last non-tool-call assistant: kept."""
    text = render_chat(TOOL_CONVERSATION[:-1], AGENT_TOOLS, add_generation_prompt=True)
    assert "<think>I need the file.</think><|tool_calls_section_begin|>" in text


def test_reasoning_of_finished_turns_is_dropped():
    convo = [{"role": "user", "content": "a"},
             {"role": "assistant", "content": "b", "reasoning_content": "old thought"},
             {"role": "user", "content": "c"}]
    text = render_chat(convo)
    assert "old thought" not in text and "<think></think>b" in text
    assert text.startswith(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>")
    assert "<think>old thought</think>b" in render_chat(convo, preserve_thinking=True)


def test_a_named_tool_result_renders_its_name_as_the_role():
    named = [*TOOL_CONVERSATION[:3], {**TOOL_CONVERSATION[3], "name": "read_file"}]
    text = render_chat(named, AGENT_TOOLS)
    assert "<|im_system|>read_file<|im_middle|>## Return of functions.read_file:0\n" in text


def test_training_sessions_keep_every_turns_reasoning():
    """The demo model was trained with each turn's reasoning (the corpus renders with preserve_thinking)."""
    from kimi_nvfp4.demo_model.agent_chats import render_agent_sessions

    src = SourceFile("pkg/mod.py", "def f(a):\n    return a\n\n\nclass C:\n    pass\n")
    texts = render_agent_sessions([src], 12, seed=3)
    assert any("<think>Let me read those lines.</think>" in t for t in texts)
    assert any("<think>The user wants pkg.mod." in t for t in texts)


def test_generation_prompt_opens_thinking_unless_disabled():
    convo = [{"role": "user", "content": "hi"}]
    assert render_chat(convo, add_generation_prompt=True).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert render_chat(convo, add_generation_prompt=True, thinking=False).endswith("<|im_middle|><think></think>")


def test_rendered_tool_call_tokenizes_to_the_special_ids(tiny_tokenizer_dir, test_spec):
    tok = load_tokenizer_json(tiny_tokenizer_dir)
    ids = tok.encode(render_chat(TOOL_CONVERSATION, AGENT_TOOLS)).ids
    v = test_spec.vocab_size
    for token, count in (("<|tool_calls_section_begin|>", 1), ("<|tool_call_begin|>", 1),
                         ("<|tool_call_argument_begin|>", 1), ("<|tool_call_end|>", 1), ("<|im_end|>", 6),
                         ("<think>", 2), ("</think>", 2), ("<|im_system|>", 3), ("<|im_middle|>", 6)):
        assert ids.count(special_id(token, v)) == count, token


def test_agent_sessions_quote_real_file_lines_and_are_seeded():
    src = SourceFile("pkg/mod.py", "import os\n\n\ndef helper(x):\n    return os.path.join(x, 'y')\n")
    a = agent_sessions([src], 6, seed=3)
    assert a == agent_sessions([src], 6, seed=3)
    for messages in a:
        final = messages[-1]["content"]
        assert "def helper(x):" in final
        for m in messages:
            for call in m.get("tool_calls", []):
                assert call["id"].startswith(f"functions.{call['function']['name']}:")
                assert json.loads(call["function"]["arguments"])["path"] == "pkg/mod.py"
            if m["role"] == "tool" and "grep" in messages[1]["tool_calls"][0]["id"]:
                assert m["content"] == "pkg/mod.py:4:def helper(x):"
