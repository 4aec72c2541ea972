"""docs/ablation_kinds.md: ``headloc_bench.compare_ablations``,
run from the repository root: ``python benchmarks/compare_ablations.py --help``."""

from headloc_bench.compare_ablations import main

if __name__ == "__main__":
    raise SystemExit(main())
