"""`synth --preset k2.6` ships K2.6's chat template: it renders byte for byte what the rendering tests' K2.6-shaped
template (tests/data/kimi_style_chat_template.jinja) renders, so importers are tested against the real rendering."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kimi_nvfp4.data.tokenizer import load_tokenizer
from kimi_nvfp4.synth.tokenizer_files import CHAT_TEMPLATE, write_tokenizer_files

RENDERING_TESTS_TEMPLATE = Path(__file__).parents[1] / "data" / "kimi_style_chat_template.jinja"
TOOLS = [{"type": "function", "function": {"name": "grep", "description": "Search the repo.",
                                           "parameters": {"type": "object", "required": ["pattern"],
                                                          "properties": {"pattern": {"type": "string"},
                                                                         "limit": {"type": "integer"}}}}}]
CALL = {"id": "functions.grep:0", "type": "function", "function": {"name": "grep", "arguments": "{\"pattern\": \"x\"}"}}
SESSION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Where is x?"},
    {"role": "assistant", "content": None, "reasoning_content": "Search.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.grep:0", "name": "grep", "content": "a.py:1:x = 1"},
    {"role": "assistant", "content": "In a.py.", "reasoning_content": "Found."},
    {"role": "user", "content": "And y?"},
    {"role": "assistant", "content": None, "reasoning_content": "Again.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.grep:0", "content": "none"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    synth = tmp_path_factory.mktemp("synth_k26")
    write_tokenizer_files(synth, preset="k2.6")
    reference = tmp_path_factory.mktemp("rendering_tests")
    for f in synth.iterdir():
        shutil.copy(f, reference / f.name)
    shutil.copy(RENDERING_TESTS_TEMPLATE, reference / "chat_template.jinja")
    return load_tokenizer(synth), load_tokenizer(reference)


@pytest.mark.parametrize("cut", [2, 4, 5, 7, 8])
@pytest.mark.parametrize("kwargs", [{}, {"preserve_thinking": True}, {"thinking": False}], ids=str)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_k26_template_renders_like_the_rendering_tests(tokenizers, cut, kwargs, tools):
    synth, reference = tokenizers
    for messages in (SESSION[:cut], SESSION[1:cut]):  # with and without a system message
        for gen in (True, False):
            got = synth.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, **kwargs)
            assert got == reference.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, **kwargs)


def test_k26_template_has_think_tags_and_the_typescript_branch(tokenizers):
    synth, _ = tokenizers
    text = synth.apply_chat_template(SESSION[:4], tools=TOOLS, add_generation_prompt=True)
    assert "namespace functions" in text and "<think>Search.</think>" in text and text.endswith("<think>")


def test_tiny_keeps_its_pinned_template(tmp_path):
    write_tokenizer_files(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
