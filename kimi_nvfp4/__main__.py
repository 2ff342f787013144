"""`python -m kimi_nvfp4 ...`: the `kimi-nvfp4` command without the console script (e.g. from a source checkout)."""

from .cli import main

if __name__ == "__main__":
    main()
