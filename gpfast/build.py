"""``python -m gpfast.build``: compile and cache the C++/CUDA ops ahead of first use."""

from gpfast._build import main

if __name__ == "__main__":
    raise SystemExit(main())
