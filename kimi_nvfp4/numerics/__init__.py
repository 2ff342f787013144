"""NVFP4 / INT4 numerics: encodings, packing, scale rules and scale-selection methods."""
