"""The committed run folders, packed and unpacked: ``headloc_bench.bench_store``,
run from the repository root: ``python benchmarks/bench_store.py --help``."""

from headloc_bench.bench_store import main

if __name__ == "__main__":
    raise SystemExit(main())
