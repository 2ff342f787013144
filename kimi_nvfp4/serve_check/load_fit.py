"""Size serve-check's work to the engine it talks to, or stop before starting it.

The default load is sized for SGLang on B200s (7 concurrency points up to 32 users, 30 turns,
100k-token prompts). Sent to `kimi-nvfp4 serve-reference`, a CPU emulator serving one request at
a time, the first request alone took more than its 600 s timeout. So when `/get_server_info`
says the server is the reference emulator, serve-check measures it (two small native /generate
requests: one prefill, one decode), projects the time of the whole load sweep and the quality
checks (one request after another, each prompt's uncached part prefilled and every output token
decoded), and stops at once with `LoadTooLarge`, suggesting `--quick`, when the projection passes
`REFERENCE_BUDGET_S`. SGLang servers are taken to be sized for the load they are given.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from .quality.humaneval import load_problems
from .quality.tool_calls import SUITES
from .report import QualityConfig
from .workload import LoadConfig, LoadTooLarge, SessionShape, session_shape

# What serve-check may spend on the reference emulator: its load sweep plus its quality checks.
REFERENCE_BUDGET_S = 20 * 60.0
# The probe: a prompt of this many (random, uncached) tokens, then this many decoded tokens.
PROBE_PROMPT_TOKENS = 64
PROBE_DECODE_TOKENS = 8
PROBE_TIMEOUT_S = 300.0
# Prompt tokens of one quality request besides its output (chat template, system prompt, question,
# tool declarations): a generous round figure, the projection is an order of magnitude.
QUALITY_PROMPT_TOKENS = 400
# Chat-template tokens around each turn's new tool result.
TURN_OVERHEAD_TOKENS = 32


@dataclass(frozen=True)
class EngineSpeed:
    prefill_s_per_token: float
    decode_s_per_token: float

    def request_s(self, prefill_tokens: int, decode_tokens: int) -> float:
        return prefill_tokens * self.prefill_s_per_token + decode_tokens * self.decode_s_per_token


def _generate(url: str, input_ids: list[int], max_new_tokens: int) -> float:
    body = json.dumps({"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                   "temperature": 0.0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=body, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as r:
        r.read()
    return time.monotonic() - start


def measure_speed(url: str, vocab_size: int, context_length: int) -> EngineSpeed:
    """Seconds per prefilled and per decoded token, from two /generate requests."""
    n = max(2, min(PROBE_PROMPT_TOKENS, context_length // 4))
    ids = [random.Random(time.monotonic_ns()).randrange(vocab_size) for _ in range(n)]  # nothing cached
    prefill_s = _generate(url, ids, 1)
    # the same prompt again is cached up to its last token: what is left is one prefill token + decoding
    decode = max(1, min(PROBE_DECODE_TOKENS, context_length - n - 2))
    decode_s = _generate(url, ids, 1 + decode)
    return EngineSpeed(prefill_s / n, decode_s / decode)


def project_load_s(cfg: LoadConfig, shape: SessionShape, speed: EngineSpeed) -> float:
    """One request at a time: every session's first context, then per turn its new tool result."""
    later = shape.tool_result_tokens + TURN_OVERHEAD_TOKENS
    session = (speed.request_s(shape.first_context_tokens, shape.output_tokens)
               + (shape.turns - 1) * speed.request_s(later, shape.output_tokens))
    return sum(cfg.concurrency) * cfg.sessions_per_user * session


def project_quality_s(cfg: QualityConfig, speed: EngineSpeed) -> float:
    """Worst case: every reply runs to its max tokens."""
    total = 0.0
    if cfg.humaneval:
        problems = cfg.humaneval_limit or len(load_problems())
        total += problems * speed.request_s(QUALITY_PROMPT_TOKENS, cfg.humaneval_max_tokens)
    if cfg.tool_calls:
        prompts = len(SUITES[cfg.tool_call_suite].prompts)
        total += min(prompts, cfg.tool_call_limit or prompts) * speed.request_s(QUALITY_PROMPT_TOKENS,
                                                                                 cfg.tool_call_max_tokens)
    if cfg.agreement:
        total += (cfg.agreement_limit or 6) * speed.request_s(QUALITY_PROMPT_TOKENS, cfg.agreement_max_new_tokens)
    return total


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def check_reference_fit(url: str, server_info: dict, load: LoadConfig | None, quality: QualityConfig,
                        *, budget_s: float | None = None) -> float:
    """The projected seconds of serve-check's work on the reference emulator at `url`.

    Raises LoadTooLarge when it passes `budget_s` (default REFERENCE_BUDGET_S), or when the load's
    sessions do not fit the server's context at all.
    """
    budget_s = REFERENCE_BUDGET_S if budget_s is None else budget_s
    context = int(server_info.get("context_length") or 0)
    vocab = int(server_info.get("vocab_size") or 0)
    if not context or not vocab:
        return 0.0  # an older reference server that does not say: nothing to size against
    try:
        speed = measure_speed(url, vocab, context)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise LoadTooLarge(f"could not measure the reference emulator at {url} ({e}); try --quick") from None
    load_s = 0.0
    if load is not None and load.concurrency:
        shape = session_shape(load, context)
        load_s = project_load_s(load, shape, speed)
    quality_s = project_quality_s(quality, speed)
    total = load_s + quality_s
    if total > budget_s:
        what = []
        if load is not None and load.concurrency:
            what.append(f"the load sweep ({len(load.concurrency)} points up to {max(load.concurrency)} users, "
                        f"{load.turns} turns, prompts up to {shape.last_prompt_tokens:,} tokens): ~{_hours(load_s)}")
        what.append(f"the quality checks: ~{_hours(quality_s)}")
        raise LoadTooLarge(
            f"the server at {url} is the kimi-nvfp4 reference emulator (one request at a time, measured "
            f"{1 / speed.prefill_s_per_token:,.0f} prefill and {1 / speed.decode_s_per_token:,.1f} decode tokens/s); "
            f"the requested work would take about {_hours(total)} ({'; '.join(what)}), more than the "
            f"{_hours(budget_s)} allowed for the emulator. Use --quick (sized for it), or shrink --concurrency, "
            "--turns, --input-tokens and --humaneval-limit.")
    return total
