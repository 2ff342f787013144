"""YaRN rope tables and softmax scale equal transformers' for K2.6's real rope config."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb_interleave,
    yarn_apply_mscale,
)

from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.errors import UnsupportedCheckpointError
from kimi_nvfp4.model.rope import RotaryEmbedding, apply_rope_interleaved, yarn_mscale
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

K26_ROPE = {
    "beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096, "type": "yarn",
}


def k2_config(rope_scaling, **over) -> K2Config:
    return K2Config.from_dict({**deepseek_v3_text_config("k2.6"), "rope_scaling": rope_scaling, **over})


def hf_rope(cfg: K2Config):
    rs = dict(cfg.rope_scaling)
    params = {"rope_type": rs.pop("type"), "rope_theta": cfg.rope_theta, **rs}
    hf = DeepseekV3Config(
        qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=params,
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    return inv_freq, attention_factor, yarn_apply_mscale(hf.rope_parameters, cfg.qk_head_dim**-0.5)


@pytest.mark.parametrize(
    "rope",
    [
        pytest.param(K26_ROPE, id="k2.6"),
        pytest.param({**K26_ROPE, "beta_fast": 32.0, "mscale": 0.707, "mscale_all_dim": 0.707}, id="deepseek-v3"),
        pytest.param({**K26_ROPE, "mscale": 1.0, "mscale_all_dim": 0.5, "factor": 40.0}, id="unequal-mscales"),
    ],
)
def test_yarn_tables_match_transformers(rope):
    cfg = k2_config(rope)
    ours = RotaryEmbedding.from_config(cfg)
    inv_freq, attention_factor, softmax_scale = hf_rope(cfg)
    assert torch.equal(ours.inv_freq, inv_freq)
    assert ours.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert ours.softmax_scale == pytest.approx(softmax_scale, rel=1e-12)


def test_k26_softmax_scale_carries_mscale_squared():
    ours = RotaryEmbedding.from_config(k2_config(K26_ROPE))
    assert ours.attention_factor == 1.0  # mscale == mscale_all_dim
    assert ours.softmax_scale == pytest.approx(192**-0.5 * yarn_mscale(64.0, 1.0) ** 2)
    assert yarn_mscale(64.0, 1.0) == pytest.approx(0.1 * torch.log(torch.tensor(64.0)).item() + 1)


def test_rotation_matches_transformers_interleave():
    rope = RotaryEmbedding.from_config(k2_config(K26_ROPE))
    positions = torch.tensor([0, 1, 4095, 4096, 200_000])
    cos, sin = rope.cos_sin(positions, "cpu", torch.float32)
    q = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
    ours = apply_rope_interleaved(q, cos, sin)
    # transformers wants [batch, heads, seq, dim] and cat(freqs, freqs) tables
    full_cos, full_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    ref, _ = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], q.transpose(0, 1)[None], full_cos, full_sin)
    assert torch.equal(ours, ref[0].transpose(0, 1))
    assert torch.equal(ours[0], torch.cat([q[0, :, 0::2], q[0, :, 1::2]], -1))  # position 0: identity (permuted)


def test_unsupported_rope_type_is_refused():
    with pytest.raises(UnsupportedCheckpointError, match="rope_scaling type 'longrope'"):
        RotaryEmbedding.from_config(k2_config({"type": "longrope", "factor": 2.0}))


def test_no_rope_scaling_is_plain_rope():
    cfg = k2_config(None)
    ours = RotaryEmbedding.from_config(cfg)
    expected = 1.0 / (cfg.rope_theta ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    assert torch.equal(ours.inv_freq, expected)
    assert ours.softmax_scale == 192**-0.5
