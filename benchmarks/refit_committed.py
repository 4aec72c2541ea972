"""The committed run folders rewritten with today's code: ``headloc_bench.refit_committed``,
run from the repository root: ``python benchmarks/refit_committed.py --help``."""

from headloc_bench.refit_committed import main

if __name__ == "__main__":
    raise SystemExit(main())
