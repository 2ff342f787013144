"""The gate that carries over to any model size: the checkpoint against Model Optimizer's own rule.

Absolute thresholds (KL <= x nats) measured on a 6.6M-parameter demo say little about a 1T model. So validate
also builds, layer by layer in memory, the conversion Model Optimizer's default recipe would give the SAME INT4
experts (`amax`: block scale = block amax / 6, `NVFP4QTensor`'s rule, bit-exact) and runs it as one more W4A16
stream. The checkpoint fails when it is worse than that baseline by more than a stated margin, end to end (KL)
and at any layer (hidden-state drift): a broken conversion, whatever the model size, is worse than plain
round-to-nearest; a good one is better (int4-aware measured 0.60x amax's W4A16 KL on the demo,
docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

from ..model.layer_weights import LayerWeights, MLPWeights, MoEWeights
from ..model.linear import ActivationMode, Int4Linear, NVFP4Linear
from ..numerics.methods import Int4Matrix, ScaleMethod, quantize_int4_groups

BASELINE_METHOD = ScaleMethod.AMAX
# The emulation mode of the baseline stream: weights only, so that it needs no input scales of its own.
BASELINE_MODE = ActivationMode.W4A16
BASELINE_NAME = f"baseline-{BASELINE_METHOD.value}"
# `--baseline auto` runs the baseline from this many held-out tokens on: below it the ratio of two small KLs
# is dominated by which tokens were drawn (measured: 1.40x on 64 tokens of a tiny synthetic model, where
# 3 x 48 tokens gave < 1.1x).
BASELINE_MIN_TOKENS = 16384


def baseline_enabled(setting: str, tokens: int) -> bool:
    """Whether validate runs the amax baseline stream (`--baseline auto|on|off`)."""
    return setting == "on" or (setting == "auto" and tokens >= BASELINE_MIN_TOKENS)


def baseline_layer(int4: LayerWeights, nvfp4: LayerWeights) -> LayerWeights:
    """`nvfp4` with its routed experts replaced by the `amax` conversion of `int4`'s experts (W4A16).

    Everything else (attention, norms, router, shared experts) is the checkpoint's own, as loaded. The experts are
    unpacked and converted one at a time: each scale group converts on its own (`quantize_int4_groups`), so the
    bytes are those of one call over the layer, and only one expert's unpacked INT4 (int8 codes, fp32 group scales)
    is held beside the converted ones instead of the whole layer's (17.7 GiB at K2.6; stage_kit/memory_estimate.py
    `baseline_build`)."""
    if not isinstance(int4.mlp, MoEWeights) or not isinstance(nvfp4.mlp, MoEWeights):
        return nvfp4
    experts = []
    for ref, out in zip(int4.mlp.experts, nvfp4.mlp.experts):
        mats = []
        for lin in (ref.gate_proj, ref.up_proj, ref.down_proj):
            if not isinstance(lin, Int4Linear):
                raise ValueError(f"{lin.module}: the source expert is not INT4")
            mats.append(Int4Matrix.from_packed(lin.weight_packed, lin.weight_scale, lin.in_features))
        # gate+up share one weight_scale_2, as convert does
        (gate, up), (down,) = quantize_int4_groups([mats[:2], mats[2:]], BASELINE_METHOD).tensors
        del mats
        experts.append(MLPWeights(*(
            NVFP4Linear(lin.module, t, lin.dtype, mode=BASELINE_MODE)
            for lin, t in zip((out.gate_proj, out.up_proj, out.down_proj), (gate, up, down))
        )))
    return dataclasses.replace(nvfp4, mlp=dataclasses.replace(nvfp4.mlp, experts=experts))
