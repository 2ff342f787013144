"""Request bodies of the reference server, validated the way SGLang 0.5.23 validates them.

Every malformed request is a `BadRequest` (HTTP 400) with a message naming the field, never a
bare 500: a body that is not a JSON object, token ids outside the vocabulary, non-integer seeds,
negative temperature, top_p outside (0, 1], a prompt or a token budget beyond the model's context.

Token budgets (`resolve_max_new_tokens`):
- chat `max_tokens` / `max_completion_tokens`: OpenAI's rule, an integer >= 1 (0 is a 400; SGLang
  0.5.23 itself reads 0 as "absent" through `max_completion_tokens or max_tokens`, protocol.py,
  which silently means "until the context is full"; we refuse it instead of guessing); absent:
  until a stop token or the context is full (SGLang: scheduler.init_req_max_new_tokens);
- native `/generate` `sampling_params.max_new_tokens`: SGLang's rule, an integer >= 0, default 128
  (sampling_params.py); 0 runs the prompt and returns no token;
- a prompt that fills the context, or prompt + max_new_tokens beyond it: 400 with SGLang's message
  (tokenizer_manager._validate_one_request); the server's `max_new_tokens_limit` then caps what is
  left (SGLang's SGLANG_MAX_NEW_TOKENS_LIMIT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .engine import SamplingParams

# Tokens one request may generate unless the server is told otherwise: the context (256k for K2) is
# no default for an emulator that runs a few tokens a second; SGLANG_MAX_NEW_TOKENS_LIMIT's role.
DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096
# sglang/srt/sampling/sampling_params.py: SamplingParams.max_new_tokens default (native /generate).
NATIVE_DEFAULT_MAX_NEW_TOKENS = 128
# sglang/srt/entrypoints/openai/protocol.py ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS (chat
# requests that name none and a generation_config.json without one).
CHAT_DEFAULT_TEMPERATURE = 1.0
CHAT_DEFAULT_TOP_P = 1.0
# sampling_params.py verify(): sampling_seed must fit a signed 64-bit integer.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1


class BadRequest(Exception):
    """The request is malformed or asks for what the model cannot do: HTTP 400."""

    status = 400


class ServerBusy(Exception):
    """The request queue is full: HTTP 503, as SGLang's --max-queued-requests answers."""

    status = 503


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got a JSON {_json_type(body)}")
    return body


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _integer(value: Any, name: str) -> int:
    """An integer, or a float with no fraction (JSON `1e9`, which pydantic reads as an int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise BadRequest(f"'{name}' must be an integer, got {value!r}")
        value = int(value)
    return value


def _optional_int(body: dict, name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    v = _integer(value, name)
    if minimum is not None and v < minimum:
        raise BadRequest(f"'{name}' must be at least {minimum}, got {v}")
    return v


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number, got {value!r}")
    return float(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, got {value!r}")
    return value


def _seed(body: dict, name: str) -> int | None:
    seed = _optional_int(body, name)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise BadRequest(f"'{name}' must be in [-2**63, 2**63 - 1], got {seed}")
    return seed


def _sampling(body: dict, *, temperature_default: float, top_p_default: float, seed_field: str) -> dict:
    temperature = _number(body, "temperature", temperature_default)
    if temperature < 0.0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {temperature}")
    top_p = _number(body, "top_p", top_p_default)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    return {"temperature": temperature, "top_p": top_p, "seed": _seed(body, seed_field),
            "ignore_eos": _flag(body, "ignore_eos")}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    max_new_tokens: int | None  # None: until a stop token or the context is full
    sampling: dict  # temperature, top_p, seed, ignore_eos
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


def parse_chat_request(body: Any, defaults: dict | None = None) -> ChatRequest:
    """An OpenAI chat-completions body; `defaults` are generation_config.json's temperature/top_p."""
    body = require_object(body)
    defaults = defaults or {}
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be an array of objects")
    if body.get("tool_choice") == "none":
        tools = None
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    # max_completion_tokens wins over the deprecated max_tokens (protocol.py to_sampling_params)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object")
    return ChatRequest(
        messages=messages, tools=tools, template_kwargs=template_kwargs,
        max_new_tokens=_optional_int(body, name, minimum=1),
        sampling=_sampling(body, temperature_default=defaults.get("temperature", CHAT_DEFAULT_TEMPERATURE),
                           top_p_default=defaults.get("top_p", CHAT_DEFAULT_TOP_P), seed_field="seed"),
        stream=_flag(body, "stream"), include_usage=_flag(stream_options, "include_usage"),
        logprobs=_flag(body, "logprobs"),
    )


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: list[int] | None
    text: str | None
    max_new_tokens: int
    sampling: dict = field(default_factory=dict)
    return_logprob: bool = False


def parse_generate_request(body: Any, vocab_size: int) -> GenerateRequest:
    """SGLang's native /generate body: `input_ids` (ids in [0, vocab_size)) or `text`, `sampling_params`."""
    body = require_object(body)
    input_ids, text = body.get("input_ids"), body.get("text")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("'input_ids' must be a non-empty array of token ids")
        for i, t in enumerate(input_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise BadRequest(f"input_ids[{i}] = {t!r} is not a token id of this model "
                                 f"(integers in [0, {vocab_size}))")
    elif isinstance(text, str) and text:
        pass
    else:
        raise BadRequest("expected 'input_ids' (a non-empty array of token ids) or 'text' (a non-empty string)")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("'sampling_params' must be an object")
    max_new = _optional_int(sp, "max_new_tokens", minimum=0)
    return GenerateRequest(
        input_ids=input_ids, text=None if input_ids is not None else text,
        max_new_tokens=NATIVE_DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
        # SGLang's native default temperature is 1.0 too (SamplingParams.temperature)
        sampling=_sampling(sp, temperature_default=1.0, top_p_default=1.0, seed_field="sampling_seed"),
        return_logprob=_flag(body, "return_logprob"),
    )


def resolve_max_new_tokens(requested: int | None, prompt_tokens: int, context_length: int,
                           limit: int | None = None) -> int:
    """The tokens a request may generate, or BadRequest when it cannot fit the context (SGLang's rules)."""
    if prompt_tokens >= context_length:
        raise BadRequest(f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                         f"({context_length} tokens).")
    if requested is not None and requested + prompt_tokens > context_length:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {requested + prompt_tokens} tokens: {prompt_tokens} tokens from the input "
            f"messages and {requested} tokens for the completion. Please reduce the number of tokens in the "
            "input messages or the completion to fit within the limit.")
    room = context_length - prompt_tokens - 1 if requested is None else requested
    if limit is not None:
        room = min(room, limit)
    return max(0, room)


def sampling_params(max_new_tokens: int, sampling: dict) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, **sampling)
