"""BENCH.md's sections copied in from another machine's copy: ``headloc_bench.bench_sections``,
run from the repository root: ``python benchmarks/bench_sections.py --help``."""

from headloc_bench.bench_sections import main

if __name__ == "__main__":
    raise SystemExit(main())
