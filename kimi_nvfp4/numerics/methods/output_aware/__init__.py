"""Output-aware scale methods' machinery: calibration statistics of expert inputs (`input_stats.py`), the
calibration-weighted output error (`output_error.py`), the energy-weighted block search (`weighted_search.py`),
batched GPTQ for NVFP4 blocks (`gptq_solver.py`) and the driver with the statistics fallback and the never-worse
guard (`refine.py`). The methods themselves are `catalog/act_diag.py` and `catalog/gptq.py`."""
