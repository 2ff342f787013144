"""Build the bundled tiny K2 end to end: tokenizer -> training -> INT4 export -> held-out perplexity.

`build_demo_model(out_dir, ...)` is what `kimi-nvfp4 build-demo-model` runs. The result is a
K2.6-layout checkpoint plus `training_report.json` (settings, corpus split, timings, losses and the
held-out perplexities of the trained float32 model and of the exported INT4 checkpoint read back).
"""

from __future__ import annotations

import math
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from .. import __version__
from .agent_chats import render_agent_sessions
from .corpus import DEFAULT_HELDOUT_FRACTION, default_source_root, load_corpus
from ..checkpoint.writer import write_text_atomic
from .export import export_checkpoint, to_json
from .model_config import TinyK2Spec
from .readback import load_transformers_model
from .specials import EOS_TOKEN
from .tokenizer_build import load_tokenizer_json, train_tokenizer, write_tokenizer_files
from .train import TrainSettings, build_train_stream, encode_documents, mean_nll, measure_step_seconds, train_model

REPORT_FILE = "training_report.json"
HELDOUT_CHAT_SESSIONS = 200


@dataclass
class Perplexity:
    tokens: int
    nll: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def to_dict(self) -> dict[str, float]:
        return {"tokens": self.tokens, "nll": self.nll, "ppl": self.ppl}


@dataclass
class DemoModelReport:
    tool_version: str
    python: str
    torch: str
    transformers: str
    device: str
    seed: int
    spec: dict[str, Any]
    train: dict[str, Any]
    corpus: dict[str, Any]
    parameters: int
    checkpoint_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    perplexity: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stream(tokenizer, texts, eos: int) -> torch.Tensor:
    return torch.tensor([t for d in encode_documents(tokenizer, texts, eos) for t in d], dtype=torch.long)


def build_demo_model(
    out_dir: Path,
    *,
    device: str = "cpu",
    settings: TrainSettings | None = None,
    spec: TinyK2Spec | None = None,
    source_root: Path | None = None,
    tokenizer_dir: Path | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    heldout_chat_sessions: int = HELDOUT_CHAT_SESSIONS,
    time_budget_s: float | None = None,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> DemoModelReport:
    """Train and export the tiny K2. `tokenizer_dir` reuses an existing tokenizer (else one is trained).

    With `time_budget_s`, the step count is set from a short timing run so training takes about that
    long on this device; the report records the step count used, which reproduces the run exactly.
    """
    settings = settings or TrainSettings()
    spec = spec or TinyK2Spec()
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    corpus = load_corpus(source_root or default_source_root(), heldout_fraction=heldout_fraction)
    log(f"corpus {corpus.root}: {len(corpus.train)} train files ({corpus.train_chars} chars), "
        f"{len(corpus.heldout)} held-out files ({corpus.heldout_chars} chars)")
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer_dir is None:
            tokenizer_dir = Path(tmp) / "tokenizer"
            write_tokenizer_files(train_tokenizer((f.text for f in corpus.train), spec.vocab_size),
                                  tokenizer_dir, spec.vocab_size)
        tokenizer = load_tokenizer_json(tokenizer_dir)
        if tokenizer.get_vocab_size() != spec.vocab_size:
            raise ValueError(f"tokenizer in {tokenizer_dir} has {tokenizer.get_vocab_size()} ids, "
                             f"the model expects {spec.vocab_size}")
        eos = tokenizer.token_to_id(EOS_TOKEN)
        stream, code_tokens, chat_tokens = build_train_stream(tokenizer, corpus.train, spec, settings.chat_sessions,
                                                              settings.seed)
        heldout_code = _stream(tokenizer, [f.text for f in corpus.heldout], eos)
        heldout_chat = _stream(tokenizer, render_agent_sessions(corpus.heldout, heldout_chat_sessions,
                                                                settings.seed + 1), eos)
        seconds["data"] = time.perf_counter() - t
        log(f"train stream {stream.numel()} tokens ({code_tokens} code, {chat_tokens} chat); "
            f"held-out {heldout_code.numel()} code tokens, {heldout_chat.numel()} chat tokens")

        if time_budget_s is not None:
            per_step = measure_step_seconds(spec, stream, settings, device)
            settings = replace(settings, steps=max(1, int(time_budget_s / per_step)))
            log(f"{per_step:.4f} s/step on {device}: {settings.steps} steps fit the {time_budget_s:.0f} s budget")
        model, tlog = train_model(spec, stream, settings, device=device, heldout_stream=heldout_code,
                                  progress=progress, log=log)
        tlog.code_tokens, tlog.chat_tokens = code_tokens, chat_tokens
        seconds["train"] = tlog.seconds

        t = time.perf_counter()
        ppl: dict[str, dict[str, float]] = {}
        for label, s in (("code", heldout_code), ("chat", heldout_chat)):
            nll, n = mean_nll(model, s, settings.seq_len, settings.batch_size, device)
            ppl[f"float32_{label}"] = Perplexity(n, nll).to_dict()
        seconds["evaluate_float32"] = time.perf_counter() - t
        t = time.perf_counter()
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        n_params = sum(p.numel() for p in model.parameters())
        del model
        report = DemoModelReport(
            tool_version=__version__, python=platform.python_version(), torch=torch.__version__,
            transformers=_transformers_version(), device=device, seed=settings.seed, spec=spec.to_dict(),
            train=tlog.to_dict(), parameters=n_params, checkpoint_bytes=0, seconds=seconds, perplexity=ppl,
            corpus={"root": corpus.root, "python": sys.version.split()[0], "heldout_fraction": heldout_fraction,
                    "train_files": len(corpus.train), "heldout_files": [f.relpath for f in corpus.heldout],
                    "train_chars": corpus.train_chars, "heldout_chars": corpus.heldout_chars},
        )
        export_checkpoint(state, spec, tokenizer_dir, out_dir, seed=settings.seed, overwrite=overwrite)
        seconds["export"] = time.perf_counter() - t

    t = time.perf_counter()
    readback = load_transformers_model(out_dir, device=device)
    for label, s in (("code", heldout_code), ("chat", heldout_chat)):
        nll, n = mean_nll(readback, s, settings.seq_len, settings.batch_size, device)
        report.perplexity[f"int4_checkpoint_{label}"] = Perplexity(n, nll).to_dict()
    seconds["evaluate_int4"] = time.perf_counter() - t
    report.checkpoint_bytes = sum(p.stat().st_size for p in Path(out_dir).glob("*.safetensors"))
    write_text_atomic(Path(out_dir) / REPORT_FILE, to_json(report.to_dict()))
    for k, v in report.perplexity.items():
        log(f"held-out perplexity {k}: {v['ppl']:.3f} over {v['tokens']} tokens")
    return report


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
