"""load_tokenizer: Kimi's tiktoken layout, the tokenizers layout, chat rendering, never running checkpoint code."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from pathlib import Path

from kimi_nvfp4.data.chat_template import ChatTemplate
from kimi_nvfp4.data.conversations import Conversation
from kimi_nvfp4.data.tokenizer import KIMI_PAT_STR, NUM_RESERVED_SPECIAL_TOKENS, load_tokenizer
from kimi_nvfp4.errors import CheckpointError

TEMPLATE_PATH = Path(__file__).parent / "kimi_style_chat_template.jinja"


def test_kimi_special_ids_come_from_the_checkpoint(kimi_tokenizer, kimi_special_ids):
    for token, token_id in kimi_special_ids.items():
        assert kimi_tokenizer.special_ids[token] == token_id, token
    # unnamed slots of the 256-id block get Kimi's placeholder names, keyed by absolute id
    assert kimi_tokenizer.special_ids["<|reserved_token_163589|>"] == 163589
    assert len(kimi_tokenizer.special_ids) == NUM_RESERVED_SPECIAL_TOKENS
    assert kimi_tokenizer.vocab_size == 163840
    assert kimi_tokenizer.eos_id == 163585 and kimi_tokenizer.bos_id == 163584 and kimi_tokenizer.pad_id == 163839
    # generation stops on [EOS], <|im_end|> and generation_config's eos
    assert kimi_tokenizer.stop_ids == (163585, 163586)


def test_special_text_is_one_id_only_when_allowed(kimi_tokenizer):
    text = "<|im_user|>user<|im_middle|>hi<|im_end|>"
    ids = kimi_tokenizer.encode(text)
    assert ids[0] == 163587 and ids[-1] == 163586 and 163601 in ids
    plain = kimi_tokenizer.encode(text, allow_special=False)
    assert not any(kimi_tokenizer.is_special(i) for i in plain)
    assert kimi_tokenizer.decode(ids) == text == kimi_tokenizer.decode(plain)


def test_kimi_regex_pre_tokenizes_han_digits_and_words(kimi_tokenizer):
    text = "Hello 你好世界 it's 12345 DONE"
    ids = kimi_tokenizer.encode(text)
    assert kimi_tokenizer.decode(ids) == text
    # Every token lies inside one pre-token of Kimi's regex: Han runs and 1-3 digit groups are
    # separate pieces, so no token crosses "好|世" -> " it" or "123|45" boundaries.
    pieces = ["Hello", " ", "你好世界", " it's", " ", "123", "45", " DONE"]
    bounds, pos = set(), 0
    for p in pieces:
        pos += len(p.encode())
        bounds.add(pos)
    pos, token_ends = 0, set()
    for i in ids:
        pos += len(kimi_tokenizer.decode_bytes([i]))
        token_ends.add(pos)
    assert bounds <= token_ends
    assert "&&[^\\p{Han}]" in KIMI_PAT_STR


def test_long_runs_are_chunked_not_panicking(kimi_tokenizer):
    text = "a" * 60_000 + " " * 30_000 + "b"
    assert kimi_tokenizer.decode(kimi_tokenizer.encode(text)) == text


def test_tokenization_kimi_py_is_never_imported(kimi_tiktoken_dir, hf_tokenizer_dir, tool_call_record):
    before = set(sys.modules)
    for folder in (kimi_tiktoken_dir, hf_tokenizer_dir):
        tok = load_tokenizer(folder)
        tok.encode_chat(**_chat_args(tool_call_record))
    new = set(sys.modules) - before
    assert not any("tokenization_kimi" in name for name in new)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None) or ""
        assert str(kimi_tiktoken_dir) not in file and str(hf_tokenizer_dir) not in file


def _chat_args(record):
    return {"messages": record["messages"], "tools": record["tools"], "add_generation_prompt": True}


def test_chat_template_renders_kimi_turns_in_order(kimi_tokenizer, tool_call_record):
    text = kimi_tokenizer.apply_chat_template(**_chat_args(tool_call_record))
    order = ["<|im_system|>tool_declare<|im_middle|>", "<|im_system|>system<|im_middle|>You are a coding agent.",
             "<|im_user|>user<|im_middle|>Where is scanstring used?<|im_end|>",
             "<|im_assistant|>assistant<|im_middle|>", "<think></think>",
             "<|tool_calls_section_begin|><|tool_call_begin|>functions.grep:0<|tool_call_argument_begin|>"
             '{"pattern": "scanstring"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
             # a tool result's name is its role name, as in Kimi's templates
             "<|im_system|>grep<|im_middle|>## Return of functions.grep:0\njson/decoder.py:130:",
             # the final answer closes the turn: everything up to it is history, without reasoning
             "<think></think>It is bound at json/decoder.py:130.<|im_end|>",
             "<|im_assistant|>assistant<|im_middle|><think>"]
    positions = [text.index(piece) for piece in order[:-1]] + [text.rindex(order[-1])]
    assert positions == sorted(positions)
    assert "Search first." not in text and "Done." not in text
    kept = kimi_tokenizer.apply_chat_template(**_chat_args(tool_call_record), preserve_thinking=True)
    assert "<think>Search first.</think>" in kept and "<think>Done.</think>It is bound" in kept
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    # tools are declared as Kimi K2.5's TypeScript namespace (the template prefers tools_ts_str)
    declared = text.split("tool_declare<|im_middle|>")[1].split("<|im_end|>")[0]
    assert declared == ("# Tools\n\n## functions\nnamespace functions {\n// Search the repo.\n"
                        "type grep = (_: {\n  pattern: string\n}) => any;\n}\n")
    # no HTML escaping in tojson
    assert "&lt;" not in text and "\\u003c" not in text


def test_unsupported_tool_schema_falls_back_to_sorted_json(kimi_tokenizer, tool_call_record):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "http://elsewhere"}}}}}]
    text = kimi_tokenizer.apply_chat_template(tool_call_record["messages"], tools=tools)
    declared = json.loads(text.split("tool_declare<|im_middle|>")[1].split("<|im_end|>")[0])
    assert declared == tools and list(declared[0]["function"]) == sorted(declared[0]["function"])
    # compact separators, as the template asks
    assert '"type":"function"' in text


def test_template_kwargs_reach_the_template(kimi_tokenizer, tool_call_record):
    args = _chat_args(tool_call_record)
    assert kimi_tokenizer.apply_chat_template(**args, thinking=False).endswith("<think></think>")
    assert not kimi_tokenizer.apply_chat_template(args["messages"], add_generation_prompt=False).endswith("<think>")


def test_conversation_messages_render_like_dicts(kimi_tokenizer, tool_call_record):
    record = tool_call_record
    conv = Conversation.model_validate(record)
    assert kimi_tokenizer.apply_chat_template(conv.messages, tools=conv.tools) == \
        kimi_tokenizer.apply_chat_template(record["messages"], tools=record["tools"])


def test_hf_tokenizer_json_backend(hf_tokenizer, tool_call_record):
    assert hf_tokenizer.kind == "tokenizers"
    ids = hf_tokenizer.encode_chat(**_chat_args(tool_call_record))
    assert ids[0] == hf_tokenizer.special_ids["<|im_system|>"]
    assert hf_tokenizer.special_ids["<|im_end|>"] in ids
    text = "read_file <|im_end|> path"
    assert hf_tokenizer.decode(hf_tokenizer.encode(text)) == text
    assert hf_tokenizer.special_ids["<|im_end|>"] not in hf_tokenizer.encode(text, allow_special=False)
    assert hf_tokenizer.eos_id == hf_tokenizer.special_ids["[EOS]"]


def test_template_from_tokenizer_config_when_no_jinja_file(tmp_path, hf_tokenizer_dir):
    folder = tmp_path / "tok"
    shutil.copytree(hf_tokenizer_dir, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{% endfor %}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "[user]"


def test_sandbox_refuses_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", "evil.jinja")
    with pytest.raises(CheckpointError, match="evil.jinja"):
        template.render([{"role": "user", "content": "x"}])


def test_raise_exception_helper_names_the_file():
    template = ChatTemplate("{{ raise_exception('bad role') }}", "t.jinja")
    with pytest.raises(CheckpointError, match="t.jinja.*bad role"):
        template.render([])


@pytest.mark.parametrize("line, match", [("QUJD", "line 2"), ("!!!! 1", "line 2"), ("QUE= 7", "no gaps")])
def test_bad_tiktoken_model_names_file_and_line(tmp_path, line, match, make_kimi_tokenizer_folder):
    folder = make_kimi_tokenizer_folder(tmp_path / "k", 300, {"[BOS]": 300, "[EOS]": 301, "<|im_end|>": 302})
    lines = (folder / "tiktoken.model").read_text().splitlines()
    lines[1] = line
    (folder / "tiktoken.model").write_text("\n".join(lines))
    with pytest.raises(CheckpointError, match=f"tiktoken.model.*{match}"):
        load_tokenizer(folder)


def test_small_vocab_numbers_specials_from_rank_count(tmp_path, make_kimi_tokenizer_folder):
    folder = make_kimi_tokenizer_folder(tmp_path / "k", 300, {"[BOS]": 300, "[EOS]": 301, "<|im_end|>": 302})
    tok = load_tokenizer(folder)
    assert tok.vocab_size == 300 + NUM_RESERVED_SPECIAL_TOKENS
    assert tok.special_ids["<|reserved_token_555|>"] == 555


def test_added_token_colliding_with_bpe_rank_is_refused(tmp_path, make_kimi_tokenizer_folder):
    with pytest.raises(CheckpointError, match="collides with a BPE rank"):
        load_tokenizer(make_kimi_tokenizer_folder(tmp_path / "k", 300, {"[BOS]": 299, "[EOS]": 301, "<|im_end|>": 302}))


def test_missing_tokenizer_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="tiktoken.model or tokenizer.json"):
        load_tokenizer(tmp_path)


def test_no_template_is_a_clear_error(tmp_path, hf_tokenizer_dir):
    folder = tmp_path / "tok"
    shutil.copytree(hf_tokenizer_dir, folder)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(CheckpointError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_test_template_is_the_file_in_the_folder(kimi_tiktoken_dir):
    assert (kimi_tiktoken_dir / "chat_template.jinja").read_text() == TEMPLATE_PATH.read_text()
