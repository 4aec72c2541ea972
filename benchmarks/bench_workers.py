"""BENCH.md's workers sections: ``headloc_bench.bench_workers``,
run from the repository root: ``python benchmarks/bench_workers.py --help``."""

from headloc_bench.bench_workers import main

if __name__ == "__main__":
    raise SystemExit(main())
