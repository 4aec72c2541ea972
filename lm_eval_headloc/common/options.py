"""Option choices and constants the command line, ``RunSpec`` and their checks name,
importing nothing heavy (no torch, scikit-learn, Ray or lm-eval): each module that acts on an
option imports its choices from here, so reading or checking a spec loads none of them."""

from __future__ import annotations

__all__ = ["ABLATIONS", "COMPONENTS", "DESIGNS", "MAX_PROBE_ROWS", "PRIORS", "PROBE_ROWS",
           "RAY_TIMEOUT", "SIGNALS"]

#: The ablation kinds, the default first.
ABLATIONS: tuple[str, ...] = ("zero", "mean", "resample")

#: ``repeated_probe``'s rows by default (``--probe-rows``): on the embedded SmolLM2, 4 rows
#: (the earlier default) labelled heads that a larger probe put below the threshold (their
#: scores' standard errors up to 0.05); at 32 they are at most 0.019 (median 0.001), 8 of
#: 270 heads are too near a threshold to say, and no head labelled by one probe seed is
#: clearly not of that type by another (tests/test_head_types.py).
PROBE_ROWS = 32

#: The most rows ``--probe-rows`` may ask for: the probe's token ids are made at once (a
#: billion rows would be 500 GB), and 4,096 rows take ~15 minutes for SmolLM2 on 2 CPU cores.
MAX_PROBE_ROWS = 4096

#: --ray-timeout's default, in seconds: how long the address of a Ray cluster may take to
#: answer. Ray's own connection attempt to an address nothing listens at retries for about
#: 14 minutes (20 tries of some 40 s) and ends in a traceback, after the model has loaded.
RAY_TIMEOUT = 60.0

#: What a measurement scores: the harness metric, or the gold answer's log-likelihood.
SIGNALS: tuple[str, ...] = ("metric", "logprob")

#: ``--components``' values: what a run locates.
COMPONENTS: tuple[str, ...] = ("heads", "neurons", "heads+neurons")

#: The design kinds :func:`design_matrix` accepts.
DESIGNS: tuple[str, ...] = ("bernoulli", "stratified")

#: --prior's values: auto resolves to atp-path or none once the tasks and model are known.
PRIORS: tuple[str, ...] = ("auto", "atp-path", "atp", "ig", "none")
