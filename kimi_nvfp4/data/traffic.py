"""Served traffic: one recorded request -> the token ids the server computed, and requests -> conversations.

A recorded request carries its prompt in one of three forms, and the importers (data/sources/) keep the most
faithful one the record has:

- **token ids as served** (`prompt_ids`: SGLang dumps and level-3 logs with `input_ids`): the ids, verbatim;
- **rendered text** (`prompt_text`: SGLang's `text` field, which multimodal architectures such as K2.5/K2.6
  receive): tokenized with the checkpoint's tokenizer as SGLang does it, special-token text read as its id and no
  BOS added;
- **messages** (`messages`, `tools`, the request's own `chat_template_kwargs`: OpenAI, LiteLLM, Anthropic and
  OpenTelemetry logs): rendered with the checkpoint's chat template and the generation prompt, as SGLang's chat
  endpoint does, then tokenized the same way (re-rendered, not as served).

The completion is appended only when the request finished (`complete`: stop or length, never abort): as output
ids when recorded, else as the response message in Kimi's output grammar. A served request is one sequence;
windows are cut from it alone (data/render.py), never from two glued together.

Conversations: turn k+1 of an agent session contains turn k's whole prompt, so requests are grouped by the
session id when the source has one, else by their shared prefix: the tokens up to the end of the first user turn
(`<|im_user|>` ... `<|im_end|>`), which every later turn of the session repeats. The held-out split is then by
conversation (render.split_heldout), and the radix-tree windowing counts the shared prefix once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from .conversations import Message
from .render import ServedRequest, _without_prompt_owned, completion_text
from .tokenizer import KimiTokenizer

USER_TOKEN, END_TOKEN = "<|im_user|>", "<|im_end|>"
GROUP_ID_HEX_CHARS = 16


@dataclass(frozen=True)
class TrafficRequest:
    """One recorded request. `where` names its file and record (never its content)."""

    where: str
    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    messages: tuple[Message, ...] | None = None
    tools: tuple[dict, ...] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    output_ids: tuple[int, ...] | None = None
    output_text: str | None = None
    response: Message | None = None
    complete: bool = True
    session: str | None = None
    arrival: float | None = None  # unix seconds the server received it
    # what serve-check's replay (serve_check/replay.py) needs to send the request again, never used for windows:
    finished: float | None = None  # unix seconds the server finished it
    max_new_tokens: int | None = None  # the recorded sampling_params.max_new_tokens
    output_tokens: int | None = None  # tokens the server generated (len(output_ids), else meta completion_tokens)

    def __post_init__(self) -> None:
        forms = sum(x is not None for x in (self.prompt_ids, self.prompt_text, self.messages))
        if forms != 1:
            raise ValueError(f"{self.where}: a request needs exactly one of prompt ids, prompt text, messages")

    @property
    def as_served(self) -> bool:
        return self.prompt_ids is not None


def prompt_ids(request: TrafficRequest, tokenizer: KimiTokenizer) -> tuple[list[int], str]:
    """(the prompt's token ids, the rendered prompt text or "" when the record had ids)."""
    if request.prompt_ids is not None:
        return list(request.prompt_ids), ""
    if request.prompt_text is not None:
        text = request.prompt_text
    else:
        text = tokenizer.apply_chat_template(list(request.messages or ()), tools=list(request.tools or ()) or None,
                                             add_generation_prompt=True, **request.template_kwargs)
    return tokenizer.encode(text, allow_special=True), text


def completion_ids(request: TrafficRequest, tokenizer: KimiTokenizer, prompt_text: str) -> list[int]:
    """The completion's ids, or [] when the request did not finish (an aborted output is not what the model
    would have produced)."""
    if not request.complete:
        return []
    if request.output_ids is not None:
        return list(request.output_ids)
    if request.response is not None:
        return tokenizer.encode(_without_prompt_owned(prompt_text, completion_text(request.response)),
                                allow_special=True)
    if request.output_text is not None:
        return tokenizer.encode(request.output_text, allow_special=True)
    return []


def group_key(ids: Sequence[int], tokenizer: KimiTokenizer, session: str | None) -> str:
    """The conversation a request belongs to: its session id, else a hash of its prefix through the first user
    turn (the whole prompt when it has none)."""
    if session:
        return "s-" + hashlib.sha256(session.encode()).hexdigest()[:GROUP_ID_HEX_CHARS]
    end = len(ids)
    user, stop = tokenizer.special_ids.get(USER_TOKEN), tokenizer.special_ids.get(END_TOKEN)
    if user is not None and stop is not None:
        try:
            first_user = list(ids).index(user)
            end = list(ids).index(stop, first_user) + 1
        except ValueError:
            end = len(ids)
    prefix = np.asarray(ids[:end], dtype=np.int64).tobytes()
    digest = hashlib.blake2b(prefix, digest_size=GROUP_ID_HEX_CHARS // 2).hexdigest()
    return "p-" + digest


@dataclass
class RequestGroup:
    """The served requests of one conversation (`id` as render.split_heldout reads it), in arrival order."""

    id: str
    requests: list[ServedRequest] = field(default_factory=list)


def group_requests(requests: Iterable[TrafficRequest], tokenizer: KimiTokenizer) -> list[RequestGroup]:
    """Served requests grouped into conversations, each group in arrival order, groups in first-arrival order."""
    ordered = sorted(enumerate(requests), key=lambda ir: (ir[1].arrival if ir[1].arrival is not None else 0.0,
                                                          ir[0]))
    groups: dict[str, RequestGroup] = {}
    for _, request in ordered:
        prompt, text = prompt_ids(request, tokenizer)
        key = group_key(prompt, tokenizer, request.session)
        served = ServedRequest(key, prompt, completion_ids(request, tokenizer, text))
        groups.setdefault(key, RequestGroup(key)).requests.append(served)
    return list(groups.values())
