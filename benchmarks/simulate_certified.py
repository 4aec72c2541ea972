"""SIMULATION.md's section of runs to a certificate: ``headloc_bench.simulate_certified``,
run from the repository root: ``python benchmarks/simulate_certified.py --help``."""

from headloc_bench.simulate_certified import main

if __name__ == "__main__":
    raise SystemExit(main())
