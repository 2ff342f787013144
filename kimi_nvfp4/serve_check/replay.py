"""Replay recorded traffic as serve-check's load: the team's own requests, at their own arrival times.

`--replay SPEC` takes any served-traffic `--data` spec (`sglang-dump:DIR`, `sglang-log:DIR`, `openai:FILE`, ...;
data/sources/) and sends every recorded request again, to SGLang or the reference server:

- **arrival times** from the records (SGLang dumps: each tuple's `created` time; logs: their timestamps), in
  arrival order, each sent `(arrival - first arrival) / speed` seconds after the start: `--replay-speed 10` replays a
  day in 2.4 h, `--replay-speed 1440` in a minute. A record without a time is sent right after the one before it.
- **prompts as recorded**: token ids go to `/generate` as `input_ids` (exactly what the server computed), rendered
  text to `/generate` as `text`, message-level records to `/v1/chat/completions` (messages, tools, the request's
  own `chat_template_kwargs`).
- **output length as recorded**: a finished request is asked for the number of tokens it generated, with
  `ignore_eos`, so the replay does the recorded work whatever the served checkpoint would say; a request whose
  output length is unknown gets its recorded `max_new_tokens`, else `default_max_tokens`, and may stop early.
- **bounded concurrency**: at most `concurrency` requests in flight; a request due while all slots are busy waits,
  and how late it was sent is reported (lateness p50/p99), so an overloaded server shows as lateness and latency
  rather than as unbounded memory here.

The report holds counts and timings only: per request its arrival-order index, scheduled and actual send time,
latency, TTFT (chat requests; `/generate` is not streamed) and token counts, never the prompt.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..data.errors import DataError
from ..data.traffic import TrafficRequest
from .client import ChatClient, ChatResult
from .loadgen import LoadPoint, percentile, summarise_point

# Tokens generated for a record that says neither how many it generated nor how many it allowed.
DEFAULT_REPLAY_MAX_TOKENS = 256
DEFAULT_REPLAY_CONCURRENCY = 64


class ReplayConfig(BaseModel):
    """What to replay and how fast. Bounded: `limit` requests at most, `timeout_s` of wall clock."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(description="a served-traffic --data spec (sglang-dump:DIR, sglang-log:DIR, openai:FILE, ...)")
    speed: float = Field(1.0, gt=0.0, description="time compression: 10 sends a day of traffic in 2.4 h")
    concurrency: int = Field(DEFAULT_REPLAY_CONCURRENCY, ge=1, description="requests in flight at most")
    limit: int | None = Field(None, ge=1, description="replay the first N requests by arrival (None: all)")
    default_max_tokens: int = Field(DEFAULT_REPLAY_MAX_TOKENS, ge=1,
                                    description="for records with no output length and no max_new_tokens")
    timeout_s: float = Field(3600.0, gt=0.0, description="wall-clock limit of the whole replay")
    request_timeout_s: float = Field(600.0, gt=0.0)
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0, description="refuse a source with more unreadable records")


@dataclass(frozen=True)
class ReplayItem:
    """One request to send: where it sits in the recorded order and what to send (never reported)."""

    index: int  # position in arrival order
    scheduled_s: float  # seconds after the replay starts
    max_new_tokens: int
    ignore_eos: bool
    input_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    recorded_latency_s: float | None = None

    @property
    def prompt_tokens(self) -> int | None:
        return len(self.input_ids) if self.input_ids is not None else None


class ReplayRequestRecord(BaseModel):
    """Timings and counts of one replayed request (no prompt text or ids)."""

    model_config = ConfigDict(extra="forbid")

    index: int
    scheduled_s: float
    sent_s: float | None  # None: not sent (the replay timed out first)
    ok: bool
    latency_s: float | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class ReplayReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str
    base_url: str
    data: str
    speed: float
    concurrency: int
    recorded_requests: int  # requests the data holds
    replayed: int  # sent (limit and timeout aside, all of them)
    skipped_too_long: int  # prompts that do not fit the server's context
    recorded_span_s: float  # first to last recorded arrival
    scheduled_span_s: float  # the same after time compression
    duration_s: float
    timed_out: bool
    latency_p50_s: float | None
    latency_p99_s: float | None
    recorded_latency_p50_s: float | None  # finished - created in the records, for comparison
    lateness_p50_s: float | None  # sent - scheduled: waiting for a free slot
    lateness_p99_s: float | None
    point: LoadPoint  # the sweep table's metrics over the whole replay
    requests: list[ReplayRequestRecord]


def _messages(request: TrafficRequest) -> list[dict]:
    return [m.to_openai() for m in request.messages or ()]


def build_plan(requests: Sequence[TrafficRequest], cfg: ReplayConfig) -> list[ReplayItem]:
    """The requests in arrival order (ties and undated records keep their recorded order), each with its
    compressed send time and output budget."""
    last = None
    dated = []
    for position, request in enumerate(requests):
        arrival = request.arrival if request.arrival is not None else request.finished
        last = arrival if arrival is not None else last  # undated: right after the record before it
        dated.append((last, position, request))
    first = min((a for a, _, _ in dated if a is not None), default=0.0)
    dated = [(first if a is None else a, position, request) for a, position, request in dated]  # undated first ones
    dated.sort(key=lambda t: (t[0], t[1]))
    if cfg.limit is not None:
        dated = dated[:cfg.limit]
    t0 = dated[0][0] if dated else 0.0
    plan = []
    for index, (arrival, _, request) in enumerate(dated):
        if request.complete and request.output_tokens:
            budget, ignore_eos = request.output_tokens, True
        else:
            budget, ignore_eos = request.max_new_tokens or cfg.default_max_tokens, False
        recorded = (request.finished - request.arrival if request.finished is not None and request.arrival is not None
                    else None)
        common = dict(index=index, scheduled_s=(arrival - t0) / cfg.speed, max_new_tokens=max(1, budget),
                      ignore_eos=ignore_eos, recorded_latency_s=recorded)
        if request.prompt_ids is not None:
            plan.append(ReplayItem(input_ids=list(request.prompt_ids), **common))
        elif request.prompt_text is not None:
            plan.append(ReplayItem(text=request.prompt_text, **common))
        else:
            plan.append(ReplayItem(messages=_messages(request), tools=list(request.tools or ()) or None,
                                   template_kwargs=dict(request.template_kwargs), **common))
    return plan


def load_plan(cfg: ReplayConfig) -> tuple[list[ReplayItem], int]:
    """(the plan, how many requests the data holds); DataError when the spec holds no recorded requests."""
    from ..data.loaders import load_data_spec
    from ..data.source_registry import check_bad_fraction

    results = load_data_spec(cfg.data)
    check_bad_fraction(results, cfg.max_bad_fraction)
    requests = [r for result in results for r in result.requests]
    if not requests:
        raise DataError(f"--replay {cfg.data!r}: no recorded requests to replay (sessions have no arrival times; "
                        "use served traffic: sglang-dump:DIR, sglang-log:DIR, openai:FILE, ...)")
    return build_plan(requests, cfg), len(requests)


async def _send(client: ChatClient, item: ReplayItem, context: int | None) -> ChatResult:
    budget = item.max_new_tokens
    if context and item.prompt_tokens is not None:
        budget = max(1, min(budget, context - item.prompt_tokens - 1))
    if item.messages is not None:
        extra = {"chat_template_kwargs": item.template_kwargs} if item.template_kwargs else None
        return await client.chat(item.messages, max_tokens=budget, tools=item.tools, ignore_eos=item.ignore_eos,
                                 extra=extra)
    return await client.generate(input_ids=item.input_ids, text=item.text, max_new_tokens=budget,
                                 ignore_eos=item.ignore_eos)


async def replay(client: ChatClient, plan: Sequence[ReplayItem], cfg: ReplayConfig, context: int | None = None,
                 progress: bool = False) -> tuple[dict[int, tuple[float, ChatResult]], set[int], float, bool]:
    """Send `plan` on its schedule with at most `cfg.concurrency` in flight.

    Returns ({index: (sent_s, result)}, indices skipped as longer than the context, duration, timed out)."""
    from tqdm import tqdm

    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(cfg.concurrency)
    done: dict[int, tuple[float, ChatResult]] = {}
    too_long: set[int] = set()
    in_flight: set[asyncio.Task] = set()
    bar = tqdm(total=len(plan), desc="replay", unit="req", disable=not progress, leave=False)
    t0 = loop.time()

    async def one(item: ReplayItem, sent: float) -> None:
        try:
            done[item.index] = (sent, await _send(client, item, context))
        finally:
            slots.release()
            bar.update(1)

    async def dispatch() -> None:
        for item in plan:  # in arrival order: one task per request in flight, never one per request of the dump
            if context and item.prompt_tokens is not None and item.prompt_tokens >= context:
                too_long.add(item.index)
                bar.update(1)
                continue
            delay = t0 + item.scheduled_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            task = asyncio.create_task(one(item, loop.time() - t0))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        while in_flight:
            await asyncio.gather(*list(in_flight))

    timed_out = False
    try:
        await asyncio.wait_for(dispatch(), cfg.timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
        for task in list(in_flight):
            task.cancel()
        await asyncio.gather(*list(in_flight), return_exceptions=True)
    bar.close()
    return done, too_long, loop.time() - t0, timed_out



def summarise_replay(plan: Sequence[ReplayItem], recorded: int, cfg: ReplayConfig, sent: dict, too_long: set[int],
                     duration: float, timed_out: bool, *, label: str, base_url: str, num_gpus: int) -> ReplayReport:
    records, results, lateness = [], [], []
    for item in plan:
        if item.index in too_long:
            continue
        if item.index not in sent:
            records.append(ReplayRequestRecord(index=item.index, scheduled_s=item.scheduled_s, sent_s=None, ok=False))
            continue
        sent_s, res = sent[item.index]
        results.append(res)
        lateness.append(max(0.0, sent_s - item.scheduled_s))
        records.append(ReplayRequestRecord(
            index=item.index, scheduled_s=item.scheduled_s, sent_s=sent_s, ok=res.ok,
            latency_s=res.latency_s if res.ok else None, ttft_s=res.ttft_s, prompt_tokens=res.prompt_tokens,
            completion_tokens=res.completion_tokens, cached_tokens=res.cached_tokens))
    latencies = [r.latency_s for r in results if r.ok]
    recorded_latencies = [i.recorded_latency_s for i in plan if i.recorded_latency_s is not None]
    span = plan[-1].scheduled_s if plan else 0.0
    return ReplayReport(
        label=label, base_url=base_url, data=cfg.data, speed=cfg.speed, concurrency=cfg.concurrency,
        recorded_requests=recorded, replayed=len(results), skipped_too_long=len(too_long),
        recorded_span_s=span * cfg.speed, scheduled_span_s=span, duration_s=duration, timed_out=timed_out,
        latency_p50_s=percentile(latencies, 50), latency_p99_s=percentile(latencies, 99),
        recorded_latency_p50_s=percentile(recorded_latencies, 50),
        lateness_p50_s=percentile(lateness, 50), lateness_p99_s=percentile(lateness, 99),
        point=summarise_point(cfg.concurrency, results, duration, num_gpus, timed_out), requests=records)


async def run_replay_async(base_url: str, cfg: ReplayConfig, *, label: str, num_gpus: int = 1,
                           progress: bool = True, plan: tuple[list[ReplayItem], int] | None = None) -> ReplayReport:
    """Load the recorded requests (or take `plan`), replay them against `base_url`, and summarise."""
    items, recorded = plan if plan is not None else load_plan(cfg)
    async with ChatClient(base_url, request_timeout_s=cfg.request_timeout_s,
                          max_connections=max(cfg.concurrency, 1)) as client:
        context = await client.context_length()
        sent, too_long, duration, timed_out = await replay(client, items, cfg, context, progress)
    return summarise_replay(items, recorded, cfg, sent, too_long, duration, timed_out, label=label,
                            base_url=base_url, num_gpus=num_gpus)


def run_replay(base_url: str, cfg: ReplayConfig, *, label: str, num_gpus: int = 1,
               progress: bool = True) -> ReplayReport:
    return asyncio.run(run_replay_async(base_url, cfg, label=label, num_gpus=num_gpus, progress=progress))
