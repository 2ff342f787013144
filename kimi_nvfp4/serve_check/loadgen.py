"""Closed-loop sweep: N users each run agent sessions; the next turn starts when the reply ends.

Per concurrency point: TTFT p50/p99, TPOT, interactivity (output tokens/s per user = 1000 / TPOT ms),
throughput (input + output tokens per minute per GPU), prefix-cache hit rate from the server's
`cached_tokens`, errors. Bounded: users x sessions x turns requests, `point_timeout_s` per point.
"""

from __future__ import annotations

import asyncio
import time
import zlib

from pydantic import BaseModel, ConfigDict
from tqdm import tqdm

from .client import ChatClient, ChatResult
from .workload import READ_FILE_TOOL, AgentSession, LoadConfig, session_shape

SECONDS_PER_MINUTE = 60.0
MS_PER_S = 1000.0
MAX_ERROR_SAMPLES = 3


class LoadPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int
    requests: int
    errors: int
    error_samples: list[str]
    timed_out: bool
    duration_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_ms: float | None
    tpot_mean_ms: float | None
    interactivity_tok_s: float | None  # output tokens/s per user
    throughput_tok_min_gpu: float  # (input + output) tokens per minute per GPU
    output_tok_s: float  # all users together
    mean_prompt_tokens: float
    mean_completion_tokens: float
    cache_hit_rate: float | None  # None when the server reported no usage
    usage_missing: int


class LoadSweep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str
    base_url: str
    num_gpus: int
    context_length: int | None
    first_context_tokens: int
    tool_result_tokens: int
    output_tokens: int
    turns: int
    points: list[LoadPoint]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarise_point(concurrency: int, results: list[ChatResult], duration_s: float, num_gpus: int,
                    timed_out: bool) -> LoadPoint:
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    with_usage = [r for r in ok if r.usage_reported]
    prompt = sum(r.prompt_tokens for r in with_usage)
    completion = sum(r.completion_tokens for r in with_usage)
    tpot_p50 = percentile(tpots, 50)
    minutes = max(duration_s, 1e-9) / SECONDS_PER_MINUTE
    return LoadPoint(
        concurrency=concurrency,
        requests=len(results),
        errors=len(errors),
        error_samples=[r.error for r in errors[:MAX_ERROR_SAMPLES]],
        timed_out=timed_out,
        duration_s=duration_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        tpot_p50_ms=None if tpot_p50 is None else tpot_p50 * MS_PER_S,
        tpot_mean_ms=sum(tpots) / len(tpots) * MS_PER_S if tpots else None,
        interactivity_tok_s=None if not tpot_p50 else 1.0 / tpot_p50,
        throughput_tok_min_gpu=(prompt + completion) / minutes / num_gpus,
        output_tok_s=completion / max(duration_s, 1e-9),
        mean_prompt_tokens=prompt / len(with_usage) if with_usage else 0.0,
        mean_completion_tokens=completion / len(with_usage) if with_usage else 0.0,
        cache_hit_rate=sum(r.cached_tokens for r in with_usage) / prompt if prompt else None,
        usage_missing=len(ok) - len(with_usage),
    )


async def _user(client: ChatClient, cfg: LoadConfig, shape, concurrency: int, user: int,
                results: list[ChatResult], bar: tqdm | None) -> None:
    for s in range(cfg.sessions_per_user):
        sid = f"c{concurrency}-u{user}-s{s}"
        session = AgentSession(shape, cfg.chars_per_token, seed=zlib.crc32(f"{cfg.seed}:{sid}".encode()),
                               session_id=sid)
        for _ in range(shape.turns):
            res = await client.chat(session.messages, max_tokens=shape.output_tokens, tools=[READ_FILE_TOOL],
                                    ignore_eos=True)
            results.append(res)
            if bar is not None:
                bar.update(1)
            if not res.ok:
                break  # a failed turn ends the session: its history would be wrong
            if res.usage_reported:
                session.observe_prompt_tokens(res.prompt_tokens)
            session.add_reply_and_tool_result(res.content)
            if cfg.tool_gap_s:
                await asyncio.sleep(cfg.tool_gap_s)


async def run_point(client: ChatClient, cfg: LoadConfig, shape, concurrency: int, num_gpus: int,
                    progress: bool = True) -> LoadPoint:
    results: list[ChatResult] = []
    total = concurrency * cfg.sessions_per_user * shape.turns
    bar = tqdm(total=total, desc=f"concurrency {concurrency}", unit="req", disable=not progress, leave=False)
    t0 = time.monotonic()
    tasks = [asyncio.create_task(_user(client, cfg, shape, concurrency, u, results, bar)) for u in range(concurrency)]
    done, pending = await asyncio.wait(tasks, timeout=cfg.point_timeout_s)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            raise t.exception()
    duration = time.monotonic() - t0
    bar.close()
    return summarise_point(concurrency, results, duration, num_gpus, timed_out=bool(pending))


async def run_sweep_async(base_url: str, cfg: LoadConfig, *, label: str, num_gpus: int = 1,
                          progress: bool = True) -> LoadSweep:
    async with ChatClient(base_url, request_timeout_s=cfg.request_timeout_s) as client:
        context = await client.context_length()
        shape = session_shape(cfg, context)
        points = [await run_point(client, cfg, shape, c, num_gpus, progress) for c in cfg.concurrency]
    return LoadSweep(label=label, base_url=base_url, num_gpus=num_gpus, context_length=context,
                     first_context_tokens=shape.first_context_tokens, tool_result_tokens=shape.tool_result_tokens,
                     output_tokens=shape.output_tokens, turns=shape.turns, points=points)


def run_sweep(base_url: str, cfg: LoadConfig, *, label: str, num_gpus: int = 1, progress: bool = True) -> LoadSweep:
    return asyncio.run(run_sweep_async(base_url, cfg, label=label, num_gpus=num_gpus, progress=progress))
