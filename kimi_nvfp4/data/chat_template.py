"""Render a checkpoint's Jinja chat template in a sandbox, the way transformers does.

A chat template is data, not Python: it runs in `jinja2.sandbox.ImmutableSandboxedEnvironment`
with the same options and helpers as transformers' `_cached_compile_jinja_template`
(transformers/utils/chat_template_utils.py: trim_blocks, lstrip_blocks, loopcontrols, a `tojson`
that does not HTML-escape, `raise_exception`, `strftime_now`), so a template written for
`AutoTokenizer.apply_chat_template` renders byte for byte the same here. Nothing from the
checkpoint folder is ever imported or executed, and rendering is bounded in time and size
(template_sandbox.BoundedSandbox): a template bomb is a `ChatTemplateError`, not a hang.
Templates may not load other templates (`include`, `import`, `from`, `extends`): there is no
loader, and the error says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes

from ..errors import CheckpointError
from .errors import ChatTemplateError
from .template_sandbox import (RENDER_TIME_BUDGET_S, BoundedSandbox, TemplateBudgetExceeded, collect_output,
                               within_budget)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# tokenizer_config may hold several named templates; transformers picks this one by default.
DEFAULT_TEMPLATE_NAME = "default"
# transformers copies these legacy names for a message's reasoning into `reasoning_content`
# (chat_template_utils._alias_reasoning_fields); Kimi's template reads `reasoning_content`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Tags that load another template: a chat template is one self-contained file.
_LOADING_TAGS = {nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from ... import",
                 nodes.Extends: "extends"}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant tokens for training masks.

    transformers registers this tag; we only render, so the body is emitted unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes '<', '>', '&' and "'"; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> BoundedSandbox:
    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain(value: Any) -> Any:
    """Deep-copy into plain dicts/lists so the template cannot mutate the caller's objects."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def deep_sort_keys(value: Any) -> Any:
    """Sort every dict's keys recursively.

    Kimi's own tokenizer sorts tool schemas this way before rendering (`deep_sort_dict` in
    moonshotai's tokenization_kimi.py `apply_chat_template`), so the declared tool JSON the model
    was trained on has sorted keys; we reproduce that instead of running their code.
    """
    if isinstance(value, Mapping):
        return {k: deep_sort_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [deep_sort_keys(v) for v in value]
    return value


def alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """Give a message's reasoning under `reasoning_content` (and `thinking`), as transformers does."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and where it came from (for error messages)."""

    source: str
    origin: str  # file the template was read from
    time_budget_s: float = RENDER_TIME_BUDGET_S  # for compiling, and for each render

    def __post_init__(self) -> None:
        env = _make_environment()
        try:
            compiled = within_budget(lambda: self._compile(env), self.time_budget_s)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not parse (line {e.lineno}: {e.message})",
                                    file=self.origin) from e
        except TemplateBudgetExceeded as e:
            raise ChatTemplateError(f"chat template went past a limit while compiling: {e}", file=self.origin) from None
        object.__setattr__(self, "_compiled", compiled)

    def _compile(self, env: BoundedSandbox) -> jinja2.Template:
        tree = env.parse(self.source)
        for node_type, tag in _LOADING_TAGS.items():
            for node in tree.find_all(node_type):
                raise ChatTemplateError(f"chat template uses {{% {tag} %}} (line {node.lineno}): a chat template "
                                        "must be one self-contained file; loading other templates is not allowed",
                                        file=self.origin)
        return env.from_string(tree)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, special_tokens: Mapping[str, str] | None = None,
               **template_kwargs: Any) -> str:
        """Render `messages` (OpenAI chat format dicts) to the prompt string.

        Raises ChatTemplateError when the template fails, or goes past a limit of
        template_sandbox (time, output size, integer or string size).
        """
        plain_messages = [alias_reasoning(_plain(m)) for m in messages]
        plain_tools = _plain(list(tools)) if tools else None
        variables = dict(special_tokens or {})
        variables.update(_plain(template_kwargs))
        variables.update(messages=plain_messages, tools=plain_tools, add_generation_prompt=add_generation_prompt)
        compiled: jinja2.Template = self._compiled  # type: ignore[attr-defined]
        try:
            return within_budget(lambda: collect_output(compiled.generate(**variables)), self.time_budget_s)
        except TemplateBudgetExceeded as e:
            raise ChatTemplateError(f"chat template went past a limit while rendering: {e}", file=self.origin) from None
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}", file=self.origin) from e
        except Exception as e:  # the template's own bug (1/0, a bad call): name it, no traceback
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}",
                                    file=self.origin) from e


def find_chat_template(checkpoint_dir: Path, tokenizer_config: Mapping[str, Any] | None) -> ChatTemplate | None:
    """The checkpoint's chat template: `chat_template.jinja` first (what transformers 4.43+ saves),
    else tokenizer_config's `chat_template` (a string, or a list of {name, template})."""
    path = checkpoint_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path))
        except UnicodeDecodeError as e:
            raise ChatTemplateError("chat template is not UTF-8 text", file=path) from e
    if not tokenizer_config:
        return None
    config_path = str(checkpoint_dir / TOKENIZER_CONFIG_FILE)
    entry = tokenizer_config.get("chat_template")
    if entry is None:
        return None
    if isinstance(entry, str):
        return ChatTemplate(entry, config_path)
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, Mapping)}
        template = named.get(DEFAULT_TEMPLATE_NAME)
        if isinstance(template, str):
            return ChatTemplate(template, config_path)
        raise CheckpointError(f"chat_template list has no {DEFAULT_TEMPLATE_NAME!r} entry "
                              f"(found {sorted(map(str, named))})", file=config_path)
    raise CheckpointError(f"chat_template must be a string or a list of {{name, template}}, got {type(entry).__name__}",
                          file=config_path)
