"""The command layer: ``headloc-harness``'s subcommands as a Python API.

Each subcommand takes a ``RunSpec`` (or the same options as keyword arguments), checks
everything it can before any weights load, and writes a run folder it can resume::

    from lm_eval_headloc.commands import RunSpec, locate, verify, write_mib
    rankings = locate("runs/smol", tasks=["headloc_induction"], masks=100)
    table = verify("runs/smol", top_k=5)
    write_mib("runs/smol", "smol_mib.json")  # the ranking as a MIB circuit graph
    read_rankings("runs/smol")["headloc_induction"].top(5)  # a finished run, read only

Modules: ``spec`` (the options, their checks and a run's identity), ``runfolder``,
``engine`` (prepare, load, measure a plan), ``report`` (ranking files and figures), one
module per subcommand, and ``cli``.
"""

from ..checks import UsageError
from .cross import cross
from .export import read_mib, write_mib
from .greedy import greedy
from .locate import locate, refit
from .overlap import overlap
from .report import HeadRanking
from .result import read_rankings
from .runfolder import RunFolder, RunFolderError
from .spec import RunSpec
from .sweep import sweep
from .types import read_types, types
from .universal import universal
from .verify import verify

__all__ = ["HeadRanking", "RunFolder", "RunFolderError", "RunSpec", "UsageError", "cross",
           "greedy", "locate", "overlap", "read_mib", "read_rankings", "read_types", "refit",
           "sweep",
           "types", "universal", "verify", "write_mib"]
