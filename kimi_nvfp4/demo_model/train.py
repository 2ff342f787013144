"""Train the tiny K2 with transformers' `DeepseekV3ForCausalLM` on stdlib code plus agent chats.

transformers' DeepseekV3 is a maintained implementation of the architecture Kimi K2 uses (MLA,
sigmoid noaux_tc routing, shared expert, yarn rope, interleaved rope layout as in DeepSeek's own
checkpoints), so the trained weights mean the same thing in any K2 implementation.

Routing is balanced the way DeepSeek-V3 and Kimi K2 do it, without an auxiliary loss: after each
step every router's `e_score_correction_bias` moves by `bias_update_speed` towards under-loaded
experts (DeepSeek-V3 report §2.1.2). The bias therefore ends up non-zero, as in the real checkpoint.

Reproducible: one seed drives the model init, the document order and every batch; on CPU two runs
give identical weights; on CUDA, atomics in the MoE scatter allow last-bit differences.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .agent_chats import render_agent_sessions
from .corpus import SourceFile
from .model_config import TinyK2Spec
from .specials import EOS_TOKEN


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 3500
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    chat_sessions: int = 3000  # rendered agent sessions mixed into the code stream (~15% of tokens)
    bias_update_speed: float = 1e-3
    eval_every: int = 500
    eval_windows: int = 64

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainLog:
    settings: dict
    device: str
    seconds: float = 0.0
    tokens_seen: int = 0
    train_stream_tokens: int = 0
    code_tokens: int = 0
    chat_tokens: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean train loss since last entry)
    heldout_losses: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def encode_documents(tokenizer, texts: Sequence[str], eos_id: int) -> list[list[int]]:
    return [enc.ids + [eos_id] for enc in tokenizer.encode_batch(list(texts))]


def build_train_stream(
    tokenizer, files: Sequence[SourceFile], spec: TinyK2Spec, chat_sessions: int, seed: int
) -> tuple[torch.Tensor, int, int]:
    """One token stream: every training file and `chat_sessions` rendered chats, shuffled (seeded).

    Returns (stream, code_tokens, chat_tokens). Each document ends with [EOS].
    """
    eos = tokenizer.token_to_id(EOS_TOKEN)
    code_docs = encode_documents(tokenizer, [f.text for f in files], eos)
    chats = render_agent_sessions(files, chat_sessions, seed) if chat_sessions else []
    chat_docs = encode_documents(tokenizer, chats, eos)
    docs = code_docs + chat_docs
    random.Random(seed).shuffle(docs)
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    if int(stream.max()) >= spec.vocab_size:
        raise ValueError(f"tokenizer produced id {int(stream.max())} >= vocab_size {spec.vocab_size}")
    return stream, sum(map(len, code_docs)), sum(map(len, chat_docs))


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio * lr`."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class RouterLoadBalancer:
    """Aux-loss-free balancing: count each router's top-k choices, then nudge its correction bias."""

    def __init__(self, model: torch.nn.Module, speed: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.speed = speed
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = {id(r): torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers}
        self._hooks = [r.register_forward_hook(self._record) for r in self.routers]

    def _record(self, router, _inputs, outputs) -> None:
        # transformers' router returns (router_logits, topk_weights, topk_indices); pick the integer
        # tensor rather than a position so a reordered tuple in another transformers release still works.
        topk_indices = next(o for o in outputs if isinstance(o, torch.Tensor) and not o.is_floating_point())
        self.counts[id(router)] += torch.bincount(topk_indices.reshape(-1), minlength=router.num_experts).float()

    @torch.no_grad()
    def step(self) -> None:
        for r in self.routers:
            load = self.counts[id(r)]
            r.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)
            load.zero_()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


@torch.no_grad()
def mean_nll(model, stream: torch.Tensor, seq_len: int, batch_size: int, device: str,
             max_windows: int | None = None) -> tuple[float, int]:
    """Mean next-token NLL over non-overlapping windows of `stream` (every token predicted once)."""
    n_windows = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window of {seq_len}")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, n_windows, batch_size):
        idx = torch.arange(start, min(n_windows, start + batch_size)) * seq_len
        x = torch.stack([stream[i : i + seq_len] for i in idx.tolist()]).to(device)
        y = torch.stack([stream[i + 1 : i + seq_len + 1] for i in idx.tolist()]).to(device)
        logits = model(input_ids=x).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                         reduction="sum"))
        count += y.numel()
    model.train(was_training)
    return total / count, count


def measure_step_seconds(spec: TinyK2Spec, stream: torch.Tensor, settings: TrainSettings, device: str,
                         steps: int = 20, warmup: int = 5) -> float:
    """Wall seconds per training step on `device` (a throwaway model; used to size a time budget)."""
    probe = TrainSettings(**{**settings.to_dict(), "steps": warmup, "eval_every": 10**9})
    train_model(spec, stream, probe, device=device, progress=False, log=lambda _: None)
    probe = TrainSettings(**{**settings.to_dict(), "steps": steps, "eval_every": 10**9})
    _, tlog = train_model(spec, stream, probe, device=device, progress=False, log=lambda _: None)
    return tlog.seconds / steps


def train_model(
    spec: TinyK2Spec,
    stream: torch.Tensor,
    settings: TrainSettings,
    *,
    device: str = "cpu",
    heldout_stream: torch.Tensor | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
):
    """Train from scratch; returns (model in float32 on `device`, TrainLog)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(settings.seed)
    model = DeepseekV3ForCausalLM(spec.transformers_config()).to(device)
    model.train()
    balancer = RouterLoadBalancer(model, settings.bias_update_speed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=settings.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(settings.seed)
    max_start = stream.numel() - settings.seq_len - 1
    use_autocast = device.startswith("cuda")
    tlog = TrainLog(settings=settings.to_dict(), device=device, train_stream_tokens=stream.numel())
    running, running_n = 0.0, 0
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=settings.steps, desc="train tiny K2", unit="step")
    for step in range(settings.steps):
        starts = torch.randint(0, max_start, (settings.batch_size,), generator=gen)
        x = torch.stack([stream[s : s + settings.seq_len] for s in starts.tolist()]).to(device)
        y = torch.stack([stream[s + 1 : s + settings.seq_len + 1] for s in starts.tolist()]).to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, settings)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_autocast):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        balancer.step()
        running += loss.item()
        running_n += 1
        tlog.tokens_seen += x.numel()
        if bar is not None:
            bar.update(1)
        last = step + 1 == settings.steps
        if (step + 1) % settings.eval_every == 0 or last:
            tlog.losses.append((step + 1, running / running_n))
            msg = f"step {step + 1}: train loss {running / running_n:.4f}"
            running, running_n = 0.0, 0
            if heldout_stream is not None:
                nll, _ = mean_nll(model, heldout_stream, settings.seq_len, settings.batch_size, device,
                                  max_windows=settings.eval_windows)
                tlog.heldout_losses.append((step + 1, nll))
                msg += f", held-out loss {nll:.4f} (ppl {math.exp(nll):.2f})"
            log(msg)
    if bar is not None:
        bar.close()
    balancer.close()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    tlog.seconds = time.perf_counter() - t0
    model.eval()
    return model, tlog
