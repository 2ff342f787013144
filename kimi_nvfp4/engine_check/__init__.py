"""`kimi-nvfp4 check-engine`: the serving engines' own loaders over a converted checkpoint, on a CPU.

`check_engine(checkpoint, engine, device="auto" | "cpu" | "meta")` (engine: a name in `ENGINES`, one module per
engine in `engines/`) -> `EngineCheckReport`.
The engines are optional (`pip install 'kimi-nvfp4[engines]'` plus the --no-deps list in
requirements-engines-cpu.txt); nothing here imports them until a check runs, in a child process.
"""

from .api import check_engine
from .engine_registry import ENGINES, EngineDriver
from .report import BuildDevice, CheckCoverage, EngineCheckReport

__all__ = ["BuildDevice", "CheckCoverage", "ENGINES", "EngineCheckReport", "EngineDriver", "check_engine"]
