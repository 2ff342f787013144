"""`kimi-nvfp4 check-engine`: the serving engines' own loaders over a converted checkpoint, on a CPU.

`check_engine(checkpoint, "sglang" | "vllm", device="auto" | "cpu" | "meta")` -> `EngineCheckReport`.
The engines are optional (`pip install 'kimi-nvfp4[engines]'` plus the --no-deps list in
requirements-engines-cpu.txt); nothing here imports them until a check runs, in a child process.
"""

from .api import check_engine
from .report import BuildDevice, Engine, EngineCheckReport

__all__ = ["BuildDevice", "Engine", "EngineCheckReport", "check_engine"]
