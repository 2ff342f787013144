"""One builder of Kimi K2-layout INT4 checkpoints, shared by `synth` (random weights, real shapes), the demo
model's export (trained weights) and the tests.

What a K2-layout INT4 checkpoint is made of, and where each piece is built (docs/formats.md §1):
- `config.py`: config.json — the DeepseekV3 text config, the K2.5/K2.6 `KimiK25ForConditionalGeneration` wrapper,
  the compressed-tensors INT4 block at both levels;
- `int4.py`: routed-expert weights -> `weight_packed` / `weight_scale` / `weight_shape` by compressed-tensors'
  symmetric min-max rule (absmax / 7.5 per group of 32);
- `tokenizer_files.py`: Kimi's special tokens (ids, `added_tokens_decoder`) and writing the tokenizer files.
Tensor names follow checkpoint/layout.py; shards and the index are written by checkpoint/writer.py.
"""

from .config import (
    compressed_tensors_int4_config,
    deepseek_v3_config,
    k2_text_config,
    kimi_k25_config,
    yarn_rope_scaling,
)
from .int4 import PackedInt4, fake_quantize_int4, quantize_int4, quantize_int4_packed
from .tokenizer_files import (
    KIMI_SPECIAL_OFFSETS,
    KIMI_VOCAB_SIZE,
    SPECIAL_BLOCK_SIZE,
    added_tokens_decoder,
    special_id,
    special_tokens,
    write_text_files,
)

__all__ = [
    "KIMI_SPECIAL_OFFSETS",
    "KIMI_VOCAB_SIZE",
    "PackedInt4",
    "SPECIAL_BLOCK_SIZE",
    "added_tokens_decoder",
    "compressed_tensors_int4_config",
    "deepseek_v3_config",
    "fake_quantize_int4",
    "k2_text_config",
    "kimi_k25_config",
    "quantize_int4",
    "quantize_int4_packed",
    "special_id",
    "special_tokens",
    "write_text_files",
    "yarn_rope_scaling",
]
