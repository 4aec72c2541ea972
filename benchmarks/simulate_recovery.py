"""SIMULATION.md: ``headloc_bench.simulate_recovery``,
run from the repository root: ``python benchmarks/simulate_recovery.py --help``."""

from headloc_bench.simulate_recovery import main

if __name__ == "__main__":
    raise SystemExit(main())
