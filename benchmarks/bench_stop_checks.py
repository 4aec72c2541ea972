"""BENCH.md's section of what ending each row on its own costs a decoding step:
``headloc_bench.bench_stop_checks``, run from the repository root:
``python benchmarks/bench_stop_checks.py --help``."""

from headloc_bench.bench_stop_checks import main

if __name__ == "__main__":
    raise SystemExit(main())
