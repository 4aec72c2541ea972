"""``headloc-harness``: the command line over ``lm_eval_headloc.commands``."""
