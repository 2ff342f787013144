"""Tokenizer-side files of a synthetic Kimi checkpoint (special tokens and file writing from the checkpoint
builder, kimi_nvfp4/checkpoint_builder/tokenizer_files.py).

- `tiktoken.model`: BPE ranks in tiktoken's text format (`base64(token bytes) rank` per line):
  the 256 single bytes, then merges learned by a small real BPE run over `BPE_TRAINING_TEXT`.
- `tokenizer_config.json`: Kimi's special tokens at their real ids (docs/formats.md §1, from 163584).
- `chat_template.jinja`: for `k2.6`, K2.6's template (think tags, history rule, TypeScript tool declarations;
  assets/k2_6/chat_template.jinja); for `tiny`, Kimi's turn format without them.
- `generation_config.json`, and `tokenization_kimi.py`: remote code that must never run; it raises
  on import so any stage that executes checkpoint code fails loudly in tests.
"""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from importlib import resources
from itertools import pairwise
from pathlib import Path

from ..checkpoint_builder.tokenizer_files import (
    BOS_TOKEN,
    EOS_TOKEN,
    KIMI_VOCAB_SIZE,
    PAD_TOKEN,
    UNK_TOKEN,
    added_tokens_decoder,
    special_tokens,
    write_text_files,
)
from .configs import KIMI_BOS_ID, KIMI_EOS_ID

# Kimi's named special tokens at their real ids (docs/formats.md §1); every other id in [163584, 163840) is reserved.
KIMI_SPECIAL_TOKENS: dict[int, str] = special_tokens(KIMI_VOCAB_SIZE, reserved=False)
NUM_BPE_MERGES = 512
_PRETOKENIZE = re.compile(rb" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")

# Text the synthetic BPE is trained on: code and chat, like the workload the checkpoint is tested with.
BPE_TRAINING_TEXT = """
def convert_checkpoint(source, output, *, method="amax", device="auto", workers=1):
    reader = CheckpointReader(source)
    for shard in reader.shard_files:
        tensors = reader.load_many(reader.shard_tensors(shard))
        return {"status": "ok", "shards": len(tensors)}
import os, sys, json
from pathlib import Path
class Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]
The user asked the assistant to fix the failing test. The assistant read the file, ran the tests,
and then edited the function so that the return value is the number of tokens in the string.
Here is the traceback: Traceback (most recent call last): File "main.py", line 12, in <module>
AssertionError: expected 3 but got 4. The tool returned the following output: 5 passed, 1 failed.
"""


def train_bpe_ranks(text: str = BPE_TRAINING_TEXT, merges: int = NUM_BPE_MERGES) -> list[bytes]:
    """Tokens in rank order: 256 single bytes, then byte-pair merges by frequency (ties: largest pair)."""
    ranks = [bytes([b]) for b in range(256)]
    # Pre-split like tiktoken patterns do (a word keeps its leading space) so merges look like real ranks.
    words = Counter(_PRETOKENIZE.findall(text.encode()))
    pieces = {w: [w[i : i + 1] for i in range(len(w))] for w in words}
    seen = set(ranks)
    for _ in range(merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for w, count in words.items():
            p = pieces[w]
            for a, b in pairwise(p):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        if merged not in seen:
            ranks.append(merged)
            seen.add(merged)
        for w in words:
            p, out, i = pieces[w], [], 0
            while i < len(p):
                if i + 1 < len(p) and (p[i], p[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(p[i])
                    i += 1
            pieces[w] = out
    return ranks


def tiktoken_model_text(ranks: list[bytes]) -> str:
    return "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(ranks))


def tokenizer_config() -> dict:
    """Kimi's tiktoken `tokenizer_config.json` (tokenization_kimi.py's TikTokenTokenizer, loaded as remote code)."""
    return {
        "added_tokens_decoder": added_tokens_decoder(KIMI_SPECIAL_TOKENS),
        "additional_special_tokens": [t for t in KIMI_SPECIAL_TOKENS.values()
                                      if t not in (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, PAD_TOKEN)],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": BOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": UNK_TOKEN,
    }


CHAT_TEMPLATE = """\
{%- macro render_content(msg) -%}
{%- set c = msg.get('content') -%}
{%- if c is string -%}{{ c }}
{%- elif c is not none -%}{%- for part in c -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- set role_name = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>
{%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>
{%- else -%}<|im_system|>{{ role_name }}<|im_middle|>
{%- endif -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{{ render_content(message) }}<|tool_calls_section_begin|>
{%- for call in message['tool_calls'] -%}
<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- elif message['role'] == 'tool' -%}
## Return of {{ message['tool_call_id'] }}
{{ render_content(message) }}
{%- else -%}
{{ render_content(message) }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

GENERATION_CONFIG = {"bos_token_id": KIMI_BOS_ID, "eos_token_id": KIMI_EOS_ID, "max_length": 262144, "temperature": 1.0, "top_p": 0.95}

# Remote code stand-in: a real checkpoint ships Python here. Our stages must never import it.
TOKENIZATION_KIMI_PY = '''\
"""Synthetic stand-in for Moonshot's tokenization_kimi.py (remote code shipped inside the checkpoint).

kimi-nvfp4 must never import or execute code from a checkpoint; this file exists to prove it.
"""

raise RuntimeError("tokenization_kimi.py from a checkpoint was executed; kimi-nvfp4 must never run checkpoint code")
'''


# What a stand-in leaves beside itself when executed, so that a run that swallowed the exception still shows it.
EXECUTED_MARKER_SUFFIX = ".executed"


def remote_code_stand_in(file_name: str) -> str:
    """Python source standing in for a remote-code file a real checkpoint ships (e.g. configuration_kimi_k25.py):
    if anything ever imports it, it leaves `<file>.executed` beside itself and raises."""
    return f'''"""Synthetic stand-in for Moonshot's {file_name} (remote code shipped inside the checkpoint).

kimi-nvfp4 must never import or execute code from a checkpoint; convert copies this file byte for byte.
"""

from pathlib import Path

Path(__file__).with_name(Path(__file__).name + "{EXECUTED_MARKER_SUFFIX}").write_text("executed")
raise RuntimeError("{file_name} from a checkpoint was executed; kimi-nvfp4 must never run checkpoint code")
'''


def remote_code_file_names(config: dict) -> list[str]:
    """The config module(s) config.json's `auto_map` names (`configuration_kimi_k25.KimiK25Config` ->
    `configuration_kimi_k25.py`), which a real checkpoint ships beside `tokenization_kimi.py`."""
    auto_map = config.get("auto_map") or {}
    return sorted({f"{target.split('.')[0]}.py" for key, target in auto_map.items() if key == "AutoConfig"})


def write_remote_code_files(out_dir: Path, config: dict) -> list[str]:
    """Write the stand-ins of `remote_code_file_names(config)`; returns their names."""
    files = {name: remote_code_stand_in(name) for name in remote_code_file_names(config)}
    write_text_files(out_dir, files)
    return sorted(files)


def k26_chat_template() -> str:
    """The K2.5/K2.6 template (think tags, history rule, preserve_thinking, TypeScript tool declarations) that
    the `k2.6` preset ships, so every importer is tested against the real rendering (assets/k2_6/)."""
    return resources.files("kimi_nvfp4").joinpath("assets/k2_6/chat_template.jinja").read_text(encoding="utf-8")


def write_tokenizer_files(out_dir: Path, *, preset: str = "tiny") -> list[str]:
    """Write every non-weight file of a Kimi checkpoint except config.json. Returns the file names.

    `k2.6` ships K2.6's chat template (`k26_chat_template`); `tiny` keeps the simplified turn format its
    tests pin."""
    files = {
        "tiktoken.model": tiktoken_model_text(train_bpe_ranks()),
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2) + "\n",
        "chat_template.jinja": k26_chat_template() if preset == "k2.6" else CHAT_TEMPLATE,
        "generation_config.json": json.dumps(GENERATION_CONFIG, indent=2) + "\n",
        "tokenization_kimi.py": TOKENIZATION_KIMI_PY,
    }
    write_text_files(out_dir, files)
    return sorted(files)
