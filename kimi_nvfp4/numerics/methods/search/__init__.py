"""The weight-error block-scale search, written once: the rule as data (`rule.py`), the per-block torch reference
(`reference.py`), the CPU-table and Triton accelerations tested bit-exact against it, and the one place that picks
the path and applies the group fallback (`group.py`). docs/numerics.md explains the numbers."""
