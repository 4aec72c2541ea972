"""NEURONS.md: ``headloc_bench.bench_neurons``,
run from the repository root: ``python benchmarks/bench_neurons.py --help``."""

from headloc_bench.bench_neurons import main

if __name__ == "__main__":
    raise SystemExit(main())
