"""RECOVERY.md: ``headloc_bench.bench_recovery``,
run from the repository root: ``python benchmarks/bench_recovery.py --help``."""

from headloc_bench.bench_recovery import main

if __name__ == "__main__":
    raise SystemExit(main())
