"""Greedy agreement and logprob comparison between a server and the reference emulator.

The server decodes a fixed prompt set greedily through SGLang's native /generate (token ids in,
token ids and logprobs out, so no retokenisation blurs the comparison). The emulator then runs the
same tokens teacher-forced (`LayerStreamRunner`, one layer at a time, so it works for the full
model too) and we compare, per generated position: is the server's token the emulator's argmax,
and how far apart are the two logprobs of that token. Serving-engine loading bugs (a transposed
scale layout, gate and up swapped) show up as agreement collapsing and logprob gaps of whole nats;
kernel rounding differences stay small.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from ..client import ChatClient

PROMPTS: list[str] = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a mutex is in one paragraph.",
    "def quicksort(xs):\n    # sort the list xs and return a new list",
    "List three differences between TCP and UDP.",
    "Fix the bug: `for i in range(len(xs)): xs.remove(xs[i])`",
    "What does `git rebase --onto` do?",
]


class AgreementCase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    prompt_tokens: int
    generated_tokens: int
    agreement: float  # fraction of generated positions where the emulator's argmax is the server's token
    first_divergence: int | None
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float


class AgreementReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    activations: str
    prompts: int
    tokens: int
    agreement: float  # token-weighted over all prompts
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    cases: list[AgreementCase]


def compare_tokens(prompt_len: int, output_ids: list[int], server_logprobs: list[float],
                   ref_logits: torch.Tensor) -> tuple[float, int | None, list[float]]:
    """`ref_logits` [prompt_len + len(output) - 1, vocab] over prompt + output[:-1]: the logits at
    position p predict token p + 1. Returns (agreement, first divergence, |Δlogprob| per token)."""
    n = len(output_ids)
    if n == 0:
        return 1.0, None, []
    pred = torch.log_softmax(ref_logits[prompt_len - 1 : prompt_len - 1 + n].float(), dim=-1)
    ids = torch.tensor(output_ids, dtype=torch.long)
    match = pred.argmax(dim=-1) == ids
    ref_lp = pred.gather(1, ids[:, None])[:, 0]
    diffs = (ref_lp - torch.tensor(server_logprobs, dtype=torch.float32)).abs().tolist()
    mismatches = (~match).nonzero()
    first = int(mismatches[0, 0]) if len(mismatches) else None
    return float(match.float().mean()), first, diffs


async def server_greedy(client: ChatClient, prompt_ids: list[list[int]], max_new_tokens: int
                        ) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in prompt_ids:
        body = await client.generate_ids(ids, max_new_tokens=max_new_tokens)
        lps = body["meta_info"]["output_token_logprobs"]  # [[logprob, token_id, text|None], ...]
        out.append(([int(t) for _, t, *_ in lps], [float(lp) for lp, *_ in lps]))
    return out


def render_prompts(checkpoint: str | Path, prompts: list[str] = PROMPTS) -> list[list[int]]:
    from ...data.tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoint)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]


def reference_logits(checkpoint: str | Path, sequences: list[list[int]], *, activations: str,
                     device: str = "cpu", progress: bool = False) -> list[torch.Tensor]:
    from ...model.runner import LayerStreamRunner
    from ...model.weights import open_weights

    runner = LayerStreamRunner(open_weights(checkpoint, kind="nvfp4", activations=activations), device=device,
                               progress=progress)
    with torch.no_grad():
        return [t.cpu() for t in runner.run([torch.tensor(s, dtype=torch.long) for s in sequences])]


class AgreementSamples(BaseModel):
    """What the server produced; scored against the emulator later, once the server has freed the GPUs."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[str]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    logprobs: list[list[float]]


async def collect_agreement_samples(client: ChatClient, checkpoint: str | Path, *, max_new_tokens: int = 32,
                                    limit: int | None = None) -> AgreementSamples:
    prompts = PROMPTS[:limit] if limit else PROMPTS
    prompt_ids = render_prompts(checkpoint, prompts)
    served = await server_greedy(client, prompt_ids, max_new_tokens)
    return AgreementSamples(prompts=prompts, prompt_ids=prompt_ids, output_ids=[o for o, _ in served],
                            logprobs=[lp for _, lp in served])


def score_agreement(samples: AgreementSamples, checkpoint: str | Path, *, activations: str = "w4a4",
                    device: str = "cpu", progress: bool = False) -> AgreementReport:
    sequences = [p + out[:-1] if out else p for p, out in zip(samples.prompt_ids, samples.output_ids)]
    logits = reference_logits(checkpoint, sequences, activations=activations, device=device, progress=progress)
    cases, all_match, all_diffs = [], 0.0, []
    for text, ids, out, lps, ref in zip(samples.prompts, samples.prompt_ids, samples.output_ids, samples.logprobs,
                                        logits):
        agree, first, diffs = compare_tokens(len(ids), out, lps, ref)
        all_match += agree * len(out)
        all_diffs += diffs
        cases.append(AgreementCase(prompt=text, prompt_tokens=len(ids), generated_tokens=len(out), agreement=agree,
                                   first_divergence=first,
                                   mean_abs_logprob_diff=sum(diffs) / len(diffs) if diffs else 0.0,
                                   max_abs_logprob_diff=max(diffs, default=0.0)))
    tokens = len(all_diffs)
    return AgreementReport(activations=activations, prompts=len(cases), tokens=tokens,
                           agreement=all_match / tokens if tokens else 1.0,
                           mean_abs_logprob_diff=sum(all_diffs) / tokens if tokens else 0.0,
                           max_abs_logprob_diff=max(all_diffs, default=0.0), cases=cases)


async def run_agreement_check(client: ChatClient, checkpoint: str | Path, *, activations: str = "w4a4",
                              max_new_tokens: int = 32, device: str = "cpu", limit: int | None = None,
                              progress: bool = False) -> AgreementReport:
    """Both steps at once (for a server that can stay up while the emulator runs, e.g. the reference one)."""
    samples = await collect_agreement_samples(client, checkpoint, max_new_tokens=max_new_tokens, limit=limit)
    return await asyncio.to_thread(score_agreement, samples, checkpoint, activations=activations, device=device,
                                   progress=progress)
