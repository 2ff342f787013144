"""The tiny model's chat template: Kimi K2's turn structure, special tokens and tool-call syntax.

Structure follows Moonshot's `chat_template.jinja` for Kimi K2 / K2.5 (docs/formats.md §1):
- tools:        `<|im_system|>tool_declare<|im_middle|>{json}<|im_end|>`
- system/user:  `<|im_system|>system<|im_middle|>…<|im_end|>`, `<|im_user|>user<|im_middle|>…<|im_end|>`
- assistant:    `<|im_assistant|>assistant<|im_middle|><think>…</think>content`, then tool calls as
                `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
                {json}<|tool_call_end|>…<|tool_calls_section_end|>`, then `<|im_end|>`
- tool result:  `<|im_system|>{name or "tool"}<|im_middle|>## Return of functions.NAME:IDX\n…<|im_end|>`
  (a tool message's `name` replaces the role, as in every message of Kimi's templates)
History rule, Kimi K2-Thinking's / K2.5's: the messages up to and including the last assistant
message without tool calls are history, and history assistant turns render an empty
`<think></think>`; assistant turns after it (the tool-call loop still running) keep their
`reasoning_content`. So a whole finished session renders no reasoning at all; the prompt of a
request made inside a tool loop shows that loop's reasoning. `preserve_thinking=True` (K2.6's
template variable) keeps every turn's reasoning. The generation prompt opens `<think>` unless
`thinking=False` (K2.5/K2.6). `tojson` is used without arguments so any jinja2 environment renders it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

KIMI_CHAT_TEMPLATE = (
    "{%- macro render_content(msg) -%}"
    "{%- set c = msg.get('content') -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}"
    "{%- for part in c -%}{%- if part.get('type') == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set enable_thinking = thinking if thinking is defined else true -%}"
    "{%- set ns = namespace(last_non_tool_call_assistant=-1) -%}"
    "{%- if not preserve_thinking -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set ns.last_non_tool_call_assistant = loop.index0 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- set role_name = message.get('name') or message['role'] -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>"
    "{%- else -%}<|im_system|>{{ role_name }}<|im_middle|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_non_tool_call_assistant and message.get('reasoning_content') -%}"
    "<think>{{ message['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>"
    "{%- endif -%}"
    "{{ render_content(message) }}"
    "{%- if message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tool_call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>"
    "{%- if tool_call['function']['arguments'] is string -%}{{ tool_call['function']['arguments'] }}"
    "{%- else -%}{{ tool_call['function']['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "## Return of {{ message['tool_call_id'] }}\n{{ render_content(message) }}"
    "{%- else -%}{{ render_content(message) }}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if enable_thinking -%}<think>{%- else -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)


def _tojson(value: Any, indent: int | None = None) -> str:
    # transformers' apply_chat_template replaces jinja2's HTML-escaping tojson with plain json.dumps
    # (transformers/utils/chat_template_utils.py); do the same so '<' in code stays '<'.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    thinking: bool = True,
    preserve_thinking: bool = False,
    template: str = KIMI_CHAT_TEMPLATE,
) -> str:
    """Render OpenAI-format messages with the Kimi template in a jinja2 sandbox.

    `preserve_thinking=True` keeps the reasoning of every assistant turn (what a training corpus
    wants); False renders what a served request's prompt holds.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    return env.from_string(template).render(
        messages=list(messages), tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt, thinking=thinking, preserve_thinking=preserve_thinking,
    )
