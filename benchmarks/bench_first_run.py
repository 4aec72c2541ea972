"""BENCH.md's section of a first run against a later one: ``headloc_bench.bench_first_run``,
run from the repository root: ``python benchmarks/bench_first_run.py --help``."""

from headloc_bench.bench_first_run import main

if __name__ == "__main__":
    raise SystemExit(main())
