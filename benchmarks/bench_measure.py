"""BENCH.md's head, and its GPU and --config sections: ``headloc_bench.bench_measure``,
run from the repository root: ``python benchmarks/bench_measure.py --help``."""

from headloc_bench.bench_measure import main

if __name__ == "__main__":
    raise SystemExit(main())
