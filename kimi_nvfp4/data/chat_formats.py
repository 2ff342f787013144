"""Request logs of other chat APIs -> Kimi's messages (OpenAI chat format, as data/conversations.py validates).

- OpenAI chat-completions bodies as proxies log them, and LiteLLM spend-log rows (`messages`, `response`,
  `proxy_server_request`): already the format; the response is `choices[0].message`.
- Anthropic Messages bodies: `system` -> a system message; content blocks `text` -> content, `thinking` ->
  `reasoning_content`, `tool_use` -> `tool_calls` (arguments as JSON text), `tool_result` -> a `role: tool`
  message with its `tool_call_id` (in block order, before the user's text, as Anthropic requires them first);
  tools `{name, description, input_schema}` -> function schemas. Tool-call ids are kept verbatim: the template
  renders what the client sent. `thinking: {type: disabled}` renders with `thinking=False`.
- OpenTelemetry GenAI spans: `gen_ai.input.messages` / `gen_ai.output.messages` with typed parts (`text`,
  `reasoning`, `tool_call`, `tool_call_response`), `gen_ai.system_instructions`, `gen_ai.tool.definitions`,
  `gen_ai.conversation.id`.

Each mapper returns a `TrafficRequest` or raises ValueError naming what it could not read (the importer skips the
record and counts the reason). Images, audio and documents are refused: the text model never saw them.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping

from .conversations import Conversation, Message
from .traffic import TrafficRequest

OPENAI_COMPLETE = frozenset({"stop", "length", "tool_calls", "function_call"})
ANTHROPIC_COMPLETE = frozenset({"end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn"})
OTEL_COMPLETE = frozenset({"stop", "length", "tool_call", "tool_calls", "end_turn", "max_tokens"})


def json_field(value: Any) -> Any:
    """A column that may hold JSON text (LiteLLM and OTel export nested objects as strings)."""
    if isinstance(value, str) and value[:1] in "[{":
        return json.loads(value)
    return value


def timestamp(value: Any) -> float | None:
    """Unix seconds from a number (seconds, or nanoseconds as OTLP writes) or an ISO-8601 string."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) or (isinstance(value, str) and value.isdigit()):
        t = float(value)
        return t / 1e9 if t > 1e14 else t
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def _validated(messages: list[dict], tools: list[dict] | None) -> tuple[tuple[Message, ...], tuple[dict, ...]]:
    conv = Conversation.model_validate({"messages": messages, "tools": tools or None})
    return tuple(conv.messages), tuple(conv.tools or ())


def _request(where: str, messages: list[dict], tools: list[dict] | None, response: dict | None, complete: bool,
             *, kwargs: Mapping[str, Any] | None = None, session: str | None = None,
             arrival: float | None = None) -> TrafficRequest:
    if not messages:
        raise ValueError("no messages")
    msgs, tls = _validated(messages, tools)
    reply = Message.model_validate(response) if response is not None else None
    return TrafficRequest(where, messages=msgs, tools=tls or None, template_kwargs=dict(kwargs or {}),
                          response=reply, complete=complete and reply is not None, session=session, arrival=arrival)


def openai_request(where: str, record: Mapping[str, Any]) -> TrafficRequest:
    """A logged chat-completions request: the body itself, or `{"request": body, "response": ...}`."""
    body = json_field(record.get("request") or record.get("body") or record)
    if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list):
        raise ValueError("no `messages` list in the request body")
    response = json_field(record.get("response"))
    message, complete = None, False
    if isinstance(response, Mapping) and response.get("choices"):
        choice = response["choices"][0]
        message = {k: v for k, v in dict(choice.get("message") or {}).items()
                   if k in ("role", "content", "reasoning_content", "tool_calls")}
        complete = choice.get("finish_reason") in OPENAI_COMPLETE
    metadata = json_field(body.get("metadata")) or {}
    session = record.get("session_id") or (metadata.get("session_id") if isinstance(metadata, Mapping) else None)
    arrival = timestamp(record.get("timestamp") or record.get("startTime") or record.get("created"))
    return _request(where, body["messages"], body.get("tools"), message, complete,
                    kwargs=body.get("chat_template_kwargs"), session=session, arrival=arrival)


def litellm_row(where: str, row: Mapping[str, Any]) -> TrafficRequest:
    """A LiteLLM spend-log row (SpendLogs exported as JSONL): the original body from `proxy_server_request`,
    else the `messages` column; the reply from `response`; `session_id` when set."""
    body = json_field(row.get("proxy_server_request"))
    if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list):
        body = {"messages": json_field(row.get("messages"))}
    metadata = json_field(row.get("metadata")) or {}
    session = row.get("session_id") or (metadata.get("session_id") if isinstance(metadata, Mapping) else None)
    return openai_request(where, {"request": body, "response": row.get("response"), "session_id": session,
                                  "startTime": row.get("startTime")})


def _anthropic_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or ():
        if block.get("type") != "text":
            raise ValueError(f"unsupported content block {block.get('type')!r} in a tool result")
        parts.append(block.get("text", ""))
    return "".join(parts)


def _anthropic_message(message: Mapping[str, Any]) -> list[dict]:
    role, content = message.get("role"), message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, reasoning, calls, tool_results = [], [], [], []
    for block in content or ():
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "thinking":
            reasoning.append(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # encrypted: nothing a template could render
        elif kind == "tool_use":
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input") or {}}})
        elif kind == "tool_result":
            tool_results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                 "content": _anthropic_text(block.get("content"))})
        else:
            raise ValueError(f"unsupported content block {kind!r}")
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(texts) or None,
                 "reasoning_content": "".join(reasoning) or None, "tool_calls": calls or None}]
    return tool_results + ([{"role": role, "content": "".join(texts)}] if texts else [])


def anthropic_request(where: str, record: Mapping[str, Any]) -> TrafficRequest:
    """An Anthropic Messages request body, or `{"request": body, "response": message}`."""
    body = record.get("request") or record
    if not isinstance(body.get("messages"), list):
        raise ValueError("no `messages` list in the request body")
    messages: list[dict] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _anthropic_text(system)})
    for message in body["messages"]:
        messages.extend(_anthropic_message(message))
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                               "parameters": t.get("input_schema") or {}}}
             for t in body.get("tools") or () if "name" in t]
    kwargs = {}
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") in ("enabled", "disabled"):
        kwargs["thinking"] = thinking["type"] == "enabled"
    response, complete = record.get("response"), False
    reply = None
    if isinstance(response, Mapping) and isinstance(response.get("content"), list):
        reply = _anthropic_message({"role": "assistant", "content": response["content"]})[0]
        complete = response.get("stop_reason") in ANTHROPIC_COMPLETE
    metadata = body.get("metadata") or {}
    return _request(where, messages, tools, reply, complete, kwargs=kwargs,
                    session=record.get("session_id") or metadata.get("session_id"),
                    arrival=timestamp(record.get("timestamp")))


def _otel_parts(message: Mapping[str, Any]) -> list[dict]:
    role = message.get("role")
    texts, reasoning, calls, results = [], [], [], []
    for part in message.get("parts") or ():
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("content", "")))
        elif kind == "reasoning":
            reasoning.append(str(part.get("content", "")))
        elif kind == "tool_call":
            calls.append({"id": part["id"], "type": "function",
                          "function": {"name": part["name"], "arguments": part.get("arguments") or {}}})
        elif kind == "tool_call_response":
            response = part.get("response")
            results.append({"role": "tool", "tool_call_id": part["id"],
                            "content": response if isinstance(response, str) else json.dumps(response)})
        else:
            raise ValueError(f"unsupported message part {kind!r}")
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(texts) or None,
                 "reasoning_content": "".join(reasoning) or None, "tool_calls": calls or None}]
    if role == "tool":
        return results
    return results + ([{"role": role, "content": "".join(texts)}] if texts or not results else [])


def otel_span(where: str, attributes: Mapping[str, Any], start: Any = None) -> TrafficRequest:
    """One GenAI span's attributes (already flattened to a mapping)."""
    inputs = json_field(attributes.get("gen_ai.input.messages"))
    if not isinstance(inputs, list):
        raise ValueError("gen_ai.input.messages is not a list of messages")
    messages: list[dict] = []
    system = json_field(attributes.get("gen_ai.system_instructions"))
    if system:
        text = system if isinstance(system, str) else "".join(str(p.get("content", "")) for p in system)
        messages.append({"role": "system", "content": text})
    for message in inputs:
        messages.extend(_otel_parts(message))
    tools = []
    for t in json_field(attributes.get("gen_ai.tool.definitions")) or ():
        fn = t.get("function") or t
        tools.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                       "parameters": fn.get("parameters") or {}}})
    outputs = json_field(attributes.get("gen_ai.output.messages")) or []
    reply, complete = None, False
    if outputs:
        reply = _otel_parts({**outputs[0], "role": "assistant"})[0]
        complete = outputs[0].get("finish_reason") in OTEL_COMPLETE
    return _request(where, messages, tools, reply, complete, session=attributes.get("gen_ai.conversation.id"),
                    arrival=timestamp(start))
