"""docs/budget_split.md: ``headloc_bench.budget_split``,
run from the repository root: ``python benchmarks/budget_split.py --help``."""

from headloc_bench.budget_split import main

if __name__ == "__main__":
    raise SystemExit(main())
