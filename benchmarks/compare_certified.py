"""Certified default runs of today's code beside the committed ones:
``headloc_bench.compare_certified``, run from the repository root:
``python benchmarks/compare_certified.py --help``."""

from headloc_bench.compare_certified import main

if __name__ == "__main__":
    raise SystemExit(main())
