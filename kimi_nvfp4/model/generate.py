"""Whole-model forward with an MLA KV cache, and autoregressive generation (small models only).

The same layer code as the layer-streamed runner, with every layer resident and dequantized once.
The cache keeps, per layer, the normalised latent and roped k_pe of every token seen (see
attention.py), plus the token ids, so a prefix cache can check what it holds: `generate(...,
cache=c)` reuses the longest common prefix of `c.token_ids` and the prompt and recomputes the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention import LatentKV, rms_norm
from .decoder import attention_block, mlp_block
from .layer_weights import LayerWeights
from .rope import RotaryEmbedding
from .weights import WeightSource


@dataclass
class KVCache:
    layers: list[LatentKV | None] = field(repr=False)
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> KVCache:
        return cls([None] * num_layers, [])

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    def clone(self) -> KVCache:
        return KVCache([c.clone() if c is not None else None for c in self.layers], list(self.token_ids))

    def truncate(self, n: int) -> KVCache:
        """Keep the first n tokens (in place; returns self). n larger than seq_len is an error."""
        if not 0 <= n <= self.seq_len:
            raise ValueError(f"cannot truncate a {self.seq_len}-token cache to {n} tokens")
        self.layers = [c.truncate(n) if c is not None and n else None for c in self.layers]
        self.token_ids = self.token_ids[:n]
        return self


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only; a stop token that ended generation is included
    logprobs: list[float]  # log p(token) under the model's (temperature-1, unfiltered) distribution
    cache: KVCache  # covers prompt + new tokens except the last one (not yet fed back)
    finish_reason: str  # "stop" | "length"


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy when temperature == 0; else temperature + nucleus (top-p) sampling on CPU in float64."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.detach().to("cpu", torch.float64) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs[before >= top_p] = 0.0  # keep the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


# The NVFP4 checkpoint declares an FP8 KV cache without k/v scales (docs/formats.md §2, §3): SGLang then stores
# the MLA latent and k_pe as plain float8_e4m3fn casts (scale 1.0).
FP8_KV_CACHE_DTYPE = torch.float8_e4m3fn
_FP8_KV_MAX = 448.0


def _round_to_kv_dtype(t: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    # clamp first: torch's float8 cast is not saturating (an overflow would become NaN, not 448)
    return t.clamp(-_FP8_KV_MAX, _FP8_KV_MAX).to(kv_dtype).to(t.dtype)


class K2Model:
    """Every layer resident; forward over new tokens given a cache; generate.

    `kv_cache_dtype=torch.float8_e4m3fn` emulates `--kv-cache-dtype fp8_e4m3`: tokens read back from the
    cache (every earlier forward call's) are fp8-rounded; tokens of the current call attend to each
    other unrounded, as a prefill does.
    """

    def __init__(
        self,
        source: WeightSource,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_cache_dtype: torch.dtype | None = None,
    ):
        if kv_cache_dtype not in (None, FP8_KV_CACHE_DTYPE):
            raise ValueError(f"kv_cache_dtype must be None or torch.float8_e4m3fn, got {kv_cache_dtype}")
        self.kv_cache_dtype = kv_cache_dtype
        self.source = source
        self.config = source.config
        self.device = torch.device(device)
        self.dtype = dtype
        self.rope = RotaryEmbedding.from_config(self.config)
        self.embed_table = source.embed(self.device).to(dtype)
        self.final_norm = source.final_norm(self.device)
        self.lm_head = source.lm_head(self.device).to(dtype)
        self.layers: list[LayerWeights] = []
        for i in range(self.config.num_hidden_layers):
            w = source.layer(i, self.device, dtype)
            w.materialize()
            self.layers.append(w)

    def new_cache(self) -> KVCache:
        return KVCache.empty(len(self.layers))

    @torch.no_grad()
    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Logits `[T, vocab]` of the new tokens `input_ids` (1-d) after `cache`; returns the extended cache.

        The given cache is not modified (its tensors are shared, not copied).
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("forward needs at least one new token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.embed_table.shape[0]:
            raise ValueError(f"token ids must lie in [0, {self.embed_table.shape[0]})")
        cache = cache if cache is not None else self.new_cache()
        x = self.embed_table[ids.to(self.device)]
        new_layers: list[LatentKV | None] = []
        for w, past in zip(self.layers, cache.layers):
            h, layer_cache = attention_block(self.config, self.rope, w, x, past=past)
            x = mlp_block(self.config, w, h)
            if self.kv_cache_dtype is not None:  # idempotent on the already-rounded past
                layer_cache = LatentKV(
                    _round_to_kv_dtype(layer_cache.latent, self.kv_cache_dtype),
                    _round_to_kv_dtype(layer_cache.k_pe, self.kv_cache_dtype),
                )
            new_layers.append(layer_cache)
        logits = F.linear(rms_norm(x, self.final_norm, self.config.rms_norm_eps), self.lm_head)
        return logits, KVCache(new_layers, cache.token_ids + ids.tolist())

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_ids: Sequence[int] = (),
        cache: KVCache | None = None,
    ) -> GenerationResult:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("generate needs a non-empty prompt")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        # reuse the cached prefix, but always feed at least the last prompt token to get its logits
        if cache is not None:
            keep = min(common_prefix_len(cache.token_ids, prompt), len(prompt) - 1)
            cache = cache.clone().truncate(keep)
        else:
            cache = self.new_cache()
        logits, cache = self.forward(prompt[cache.seq_len :], cache)
        last = logits[-1]
        stops = {int(s) for s in stop_ids}
        tokens: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        for step in range(max_new_tokens):
            token = sample_token(last, temperature, top_p, generator)
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(last.to(torch.float32), dim=-1)[token]))
            if token in stops:
                finish = "stop"
                break
            if step + 1 < max_new_tokens:
                step_logits, cache = self.forward([token], cache)
                last = step_logits[-1]
        return GenerationResult(tokens, logprobs, cache, finish)


def generate(model: K2Model, prompt_ids: Sequence[int], max_new_tokens: int, **kw) -> GenerationResult:
    """Function form of `K2Model.generate` (same arguments)."""
    return model.generate(prompt_ids, max_new_tokens, **kw)
