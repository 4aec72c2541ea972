"""Research tools outside the package's core: the yardsticks recovery methods are
measured with before they cost model time (``simulation``: a planted-sparse simulator of
knockout measurements). ``scripts/simulate_recovery.py`` and
``scripts/bench_recovery.py`` use them, with the tests; nothing in the core imports this
subpackage, and it needs neither torch nor lm-eval.
"""
