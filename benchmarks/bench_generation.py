"""BENCH.md's sections of several masks per generate call: ``headloc_bench.bench_generation``,
run from the repository root: ``python benchmarks/bench_generation.py --help``."""

from headloc_bench.bench_generation import main

if __name__ == "__main__":
    raise SystemExit(main())
