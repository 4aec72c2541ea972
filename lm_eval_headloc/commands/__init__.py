"""The command layer: ``headloc-harness``'s subcommands as a Python API.

Each subcommand takes a ``RunSpec`` (or the same options as keyword arguments), checks
everything it can before any weights load, and writes a run folder it can resume::

    from lm_eval_headloc import RunSpec, locate, verify, write_mib
    rankings = locate("runs/smol", tasks=["headloc_induction"], masks=100)
    table = verify("runs/smol", top_k=5)
    write_mib("runs/smol", "smol_mib.json")  # the ranking as a MIB circuit graph
    read_rankings("runs/smol")["headloc_induction"].top(5)  # a finished run, read only

One module per subcommand; the rest of a run lives in the layers below (``runs``,
``method``, ``report``: docs/development.md).
"""

from lm_eval_headloc.commands.cross import cross
from lm_eval_headloc.commands.greedy import greedy
from lm_eval_headloc.commands.locate import locate, refit
from lm_eval_headloc.commands.overlap import overlap
from lm_eval_headloc.commands.sweep import sweep
from lm_eval_headloc.commands.types import types
from lm_eval_headloc.commands.universal import universal
from lm_eval_headloc.commands.verify import verify
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.method.ranking import Ranking
from lm_eval_headloc.report.mib import write_mib
from lm_eval_headloc.report.mib_format import read_mib
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.record import read_rankings
from lm_eval_headloc.runs.spec import RunSpec
from lm_eval_headloc.runs.types_file import read_types

__all__ = ["Ranking", "RunFolder", "RunFolderError", "RunSpec", "UsageError", "cross",
           "greedy", "locate", "overlap", "read_mib", "read_rankings", "read_types", "refit",
           "sweep",
           "types", "universal", "verify", "write_mib"]
