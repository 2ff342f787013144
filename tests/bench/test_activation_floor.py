"""bench/experiments/w4a4_floor/activation_floor.py: the W4A4 floor model is the INT4 model plus only what it claims to add.

Without input quantization, exact weights reproduce the INT4 reference's logits (bit for bit untransformed or with
power-of-two smoothing, to float rounding with the rotation), so every KL the bench reports comes from the input
quantization or the weight rule; the calibrated scales are the recorded maxima / (6 * 448)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.experiments.w4a4_floor.activation_floor import (  # noqa: E402
    DOWN,
    GATE_UP,
    INPUTS,
    FloorWeights,
    InputTransform,
    TransformKind,
    WeightRule,
    block_rotation,
    calibrate_floor_scales,
    hadamard_matrix,
    smoothing_factors,
)
from kimi_nvfp4.calibrate.expert_stats import GATE_UP as STATS_GATE_UP  # noqa: E402
from kimi_nvfp4.calibrate.expert_stats_file import LayerExpertStats  # noqa: E402
from kimi_nvfp4.checkpoint.reader import CheckpointReader  # noqa: E402
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT  # noqa: E402
from kimi_nvfp4.model import Int4SourceWeights, LayerStreamRunner  # noqa: E402
from kimi_nvfp4.numerics.constants import E2M1_MAX, E4M3_MAX  # noqa: E402
from kimi_nvfp4.numerics.methods import ExpertInputStats  # noqa: E402

SEQ_LEN = 48


def _runner(weights):
    return LayerStreamRunner(weights, progress=False)


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(0)
    with CheckpointReader(DEMO_CHECKPOINT) as reader:
        vocab = Int4SourceWeights(reader).config.vocab_size
    return [torch.randint(0, vocab, (SEQ_LEN,), generator=gen) for _ in range(2)]


@pytest.fixture(scope="module")
def reference(sequences):
    with torch.no_grad():
        return list(_runner(Int4SourceWeights(CheckpointReader(DEMO_CHECKPOINT))).run(sequences))


def _stats_with_skewed_channels() -> dict:
    """Every MoE layer's shared gate/up statistics with channel RMS spread over 2^-4..2^4 (smoothing then moves)."""
    weights = Int4SourceWeights(CheckpointReader(DEMO_CHECKPOINT))
    hidden = weights.config.hidden_size
    out = {}
    for layer in range(weights.config.num_hidden_layers):
        stats = LayerExpertStats(layer)
        energy = torch.exp2(torch.linspace(-8, 8, hidden, dtype=torch.float64))
        stats.shared[STATS_GATE_UP] = ExpertInputStats(1000, energy)
        out[layer] = stats
    return out


def _logits(weights, sequences):
    with torch.no_grad():
        return list(_runner(weights).run(sequences))


def test_hadamard_blocks_are_orthogonal_and_orders_must_be_powers_of_two():
    h = hadamard_matrix(16)
    torch.testing.assert_close(h @ h.T, torch.eye(16, dtype=torch.float64))
    r = block_rotation(64, 16, seed=3)
    torch.testing.assert_close(r @ r.T, torch.eye(64, dtype=torch.float64))
    assert torch.count_nonzero(r[:16, 16:]) == 0  # block-diagonal: NVFP4 blocks stay apart
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
    with pytest.raises(ValueError, match="does not divide"):
        block_rotation(40, 16, seed=0)


def test_smoothing_factors_are_powers_of_two_following_the_channel_rms():
    rms = torch.tensor([1.0, 4.0, 16.0, 64.0], dtype=torch.float64)
    s = smoothing_factors(rms, torch.ones(4, dtype=torch.float64), alpha=1.0)
    assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))
    assert torch.equal(s[1:] / s[:-1], torch.full((3,), 4.0, dtype=torch.float64))
    flat = smoothing_factors(rms, torch.ones(4, dtype=torch.float64), alpha=0.0)
    assert torch.equal(flat, torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("transform", [InputTransform(), InputTransform(TransformKind.SMOOTH_POW2, alpha=1.0)],
                         ids=["none", "smooth-pow2"])
def test_exact_weights_without_input_quantization_are_the_int4_model_bit_for_bit(sequences, reference, transform):
    weights = FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=WeightRule.EXACT, transform=transform,
                           quantized=(), stats=_stats_with_skewed_channels())
    got = _logits(weights, sequences)
    if transform.kind is TransformKind.SMOOTH_POW2:  # the factors really are not all one
        assert any(not torch.all(s.transform == 1) for s in weights.inputs.values() if s.transform is not None)
    for a, b in zip(got, reference):
        assert torch.equal(a, b)


def test_rotated_exact_weights_without_input_quantization_equal_the_int4_model(sequences, reference):
    weights = FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=WeightRule.EXACT,
                           transform=InputTransform(TransformKind.HADAMARD), quantized=())
    for a, b in zip(_logits(weights, sequences), reference):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0.0)


def test_calibration_sets_scales_from_the_maxima_and_quantization_then_changes_the_output(sequences, reference):
    weights = FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=WeightRule.EXACT, transform=InputTransform(),
                           quantized=(GATE_UP,))
    calibrate_floor_scales(weights, sequences, _runner)
    assert {kind for _, kind in weights.inputs} == set(INPUTS)
    for state in weights.inputs.values():
        assert state.amax > 0
        torch.testing.assert_close(state.scale, state.amax / (E2M1_MAX * E4M3_MAX), rtol=1e-6, atol=0.0)
    with pytest.raises(ValueError, match="already calibrated"):
        calibrate_floor_scales(weights, sequences, _runner)
    got = _logits(weights, sequences)
    assert not all(torch.equal(a, b) for a, b in zip(got, reference))
    # down inputs are not in `quantized`: only gate/up changed, so down's quantization adds more
    both = FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=WeightRule.EXACT, transform=InputTransform(),
                        quantized=(GATE_UP, DOWN))
    calibrate_floor_scales(both, sequences, _runner)
    assert not all(torch.equal(a, b) for a, b in zip(_logits(both, sequences), got))


def test_unknown_inputs_and_missing_statistics_are_refused():
    with pytest.raises(ValueError, match="unknown expert inputs"):
        FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=WeightRule.EXACT, transform=InputTransform(),
                     quantized=("q_proj",))
    weights = FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=WeightRule.EXACT,
                           transform=InputTransform(TransformKind.SMOOTH_POW2), quantized=INPUTS)
    with pytest.raises(ValueError, match="shared gate/up statistics"):
        weights.layer(weights.config.first_k_dense_replace)
