"""The scale methods, one module each; every module defines `METHOD = ScaleMethodSpec(...)` (see registry.py)."""
