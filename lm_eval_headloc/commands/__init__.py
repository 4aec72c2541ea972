"""The command layer: ``headloc-harness``'s subcommands as a Python API.

Each subcommand takes a ``RunSpec`` (or the same options as keyword arguments), checks
everything it can before any weights load, and writes a run folder it can resume::

    from lm_eval_headloc import RunSpec, locate, read_rankings, verify, write_mib
    rankings = locate("runs/smol", tasks=["headloc_induction"], masks=100)
    table = verify("runs/smol", top_k=5)
    write_mib("runs/smol", "smol_mib.json")  # the ranking as a MIB circuit graph
    read_rankings("runs/smol")["headloc_induction"].top(5)  # a finished run, read only

One module per subcommand. This package exports the commands only, one function per
subcommand (``export`` is ``write_mib``); what they take and return (``RunSpec``,
``RunFolder``, ``Ranking``, ``read_rankings``, ...) is imported from the module that
defines it, in the layers below (``runs``, ``method``, ``report``: docs/development.md),
or from the package's top.
"""

from lm_eval_headloc.commands.cross import cross
from lm_eval_headloc.commands.greedy import greedy
from lm_eval_headloc.commands.locate import locate, refit
from lm_eval_headloc.commands.overlap import overlap
from lm_eval_headloc.commands.sweep import sweep
from lm_eval_headloc.commands.types import types
from lm_eval_headloc.commands.universal import universal
from lm_eval_headloc.commands.verify import verify
from lm_eval_headloc.report.mib import write_mib

__all__ = ["cross", "greedy", "locate", "overlap", "refit", "sweep", "types", "universal",
           "verify", "write_mib"]
