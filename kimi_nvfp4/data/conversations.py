"""Chat sessions in OpenAI chat-completions format, validated.

One `Conversation` is one coding-agent session: messages (system/user/assistant/tool, assistant
`tool_calls`, tool results with `tool_call_id`, optional `reasoning_content` for thinking) plus
the OpenAI function schemas it declared. Its `id` is a content hash when the source gives none, so
the held-out split (render.split_heldout) is the same on every machine.
"""

from __future__ import annotations

import hashlib
import json
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Length of the hex content hash used as a conversation id.
CONVERSATION_ID_HEX_CHARS = 16
# Names older chat formats use for a message's reasoning; normalised to `reasoning_content`.
_REASONING_ALIASES = ("thinking", "reasoning")


class Role(str, Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


def _drop_none(data: Any) -> Any:
    # OpenAI SDK dumps and Arrow rows (datasets) carry absent fields as null.
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None}
    return data


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: str  # a JSON document, as OpenAI sends it

    @model_validator(mode="before")
    @classmethod
    def _arguments_as_json_text(cls, data: Any) -> Any:
        data = _drop_none(data)
        if isinstance(data, dict) and isinstance(data.get("arguments"), (dict, list)):
            data = {**data, "arguments": json.dumps(data["arguments"], ensure_ascii=False)}
        return data

    @field_validator("arguments")
    @classmethod
    def _arguments_parse(cls, value: str) -> str:
        try:
            json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool-call arguments must be a JSON string ({e.msg} at char {e.pos})") from e
        return value


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)  # Kimi uses `functions.NAME:IDX`
    type: Literal["function"] = "function"
    function: FunctionCall

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return _drop_none(data)


def _text_content(content: Any) -> Any:
    """OpenAI content may be a list of parts; keep text parts only (refuse images and audio)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts are supported, got {kind!r}")
    return "".join(texts)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        data = _drop_none(data)
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for alias in _REASONING_ALIASES:
            if alias in data:
                data.setdefault("reasoning_content", data.pop(alias))
        if "content" in data:
            data["content"] = _text_content(data["content"])
        if data.get("tool_calls") == []:
            del data["tool_calls"]
        return data

    @model_validator(mode="after")
    def _fields_fit_role(self) -> Message:
        if self.role is Role.TOOL:
            if not self.tool_call_id:
                raise ValueError("a tool message needs tool_call_id")
            if self.content is None:
                raise ValueError("a tool message needs content")
        elif self.tool_call_id is not None:
            raise ValueError(f"tool_call_id is only valid on tool messages, not {self.role.value}")
        if self.tool_calls and self.role is not Role.ASSISTANT:
            raise ValueError(f"tool_calls are only valid on assistant messages, not {self.role.value}")
        if self.role in (Role.SYSTEM, Role.USER) and self.content is None:
            raise ValueError(f"a {self.role.value} message needs content")
        if self.role is Role.ASSISTANT and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def to_openai(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def _check_tool_schema(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ValueError(f"a tool must be an object, got {type(tool).__name__}")
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError("a tool must look like {type: function, function: {name, description, parameters}}")
    return tool


def content_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Stable id: sha256 of the canonical JSON of the messages and tools."""
    canonical = json.dumps({"messages": messages, "tools": tools or []}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:CONVERSATION_ID_HEX_CHARS]


class Conversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    id: str = ""

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_from_json_text(cls, value: Any) -> Any:
        # Some datasets store the tool list as a JSON string.
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else None
        if value == []:
            return None
        if isinstance(value, list):
            return [_check_tool_schema(t) for t in value]
        return value

    @model_validator(mode="after")
    def _tool_results_answer_calls(self) -> Conversation:
        issued: set[str] = set()
        for index, message in enumerate(self.messages):
            for call in message.tool_calls or ():
                issued.add(call.id)
            if message.role is Role.TOOL and message.tool_call_id not in issued:
                raise ValueError(f"message {index}: tool result for {message.tool_call_id!r} "
                                 "answers no earlier tool call")
        if not any(m.role in (Role.USER, Role.ASSISTANT) for m in self.messages):
            raise ValueError("a conversation needs at least one user or assistant message")
        if not self.id:
            self.id = content_id([m.to_openai() for m in self.messages], self.tools)
        return self

    def openai_messages(self) -> list[dict[str, Any]]:
        return [m.to_openai() for m in self.messages]

    def to_json_line(self) -> str:
        """One JSONL line: {"id", "messages", "tools"} (tools omitted when none)."""
        record: dict[str, Any] = {"id": self.id, "messages": self.openai_messages()}
        if self.tools:
            record["tools"] = self.tools
        return json.dumps(record, ensure_ascii=False)

    @property
    def num_user_turns(self) -> int:
        return sum(1 for m in self.messages if m.role is Role.USER)

    @property
    def num_tool_calls(self) -> int:
        return sum(len(m.tool_calls or ()) for m in self.messages)
