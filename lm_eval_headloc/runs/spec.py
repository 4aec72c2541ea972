"""``RunSpec``: every option of a measuring run, defined once.

A run of ``locate``, ``greedy``, ``sweep`` or ``verify`` is described by one frozen
``RunSpec``, built from argparse (``RunSpec.from_namespace``) or from Python keyword
arguments (``RunSpec(tasks=("gsm8k",), masks=200)``). Each field carries its own
default, help text and role, so that:

- the CLI's flags and defaults are generated from the fields (``cli.options``), never
  restated;
- ``validate`` checks every value before anything is loaded;
- ``identity(command)`` — what resume compares — is every field that can change the
  command's measurements, so no option can be forgotten.

Roles: ``result`` fields define what is measured; ``setting`` fields only change how
the stored measurements are ranked (``refit`` may change them on a ``locate`` run);
``runtime`` fields change how fast or how loudly a run goes, never its numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.checks import UsageError, as_python, check_number
from lm_eval_headloc.common.options import (
    ABLATIONS,
    COMPONENTS,
    DESIGNS,
    MAX_PROBE_ROWS,
    PRIORS,
    PROBE_ROWS,
    RAY_TIMEOUT,
    SIGNALS,
)
from lm_eval_headloc.method.budget import (
    ALL_ALONE_MASKS,
    ALL_ALONE_UP_TO,
    AUTO_CAP_SHARE,
    DEFAULT_ALONE,
    DEFAULT_MASKS,
    cap_refusal,
    default_split,
    fixed_part,
    measurement_cap,
    measures_all_alone,
)
from lm_eval_headloc.runs.option_values import (
    ABLATION_FLAGS,
    HARNESS_MODEL_ARGS,
    MAX_COUNT,
    RESULT,
    RUNTIME,
    SETTING,
    canonical_gen_kwargs,
    check_model_args,
    comma_list,
    flag_of,
    parse_batch_size,
    parse_candidates,
    parse_examples_part,
    parse_gen_kwargs,
    parse_masks,
    parse_max_measurements,
    parse_sparsity,
    refuse_keywords,
)
from lm_eval_headloc.runs.option_values import option as _option

__all__ = ["ABLATION_FLAGS", "AUTO_CAP_SHARE", "COMMAND_OPTIONS", "DEFAULT_MAX_MASKS",
           "DEFAULT_TASK", "HARNESS_MODEL_ARGS", "RESULT", "RUNTIME", "SETTING", "RunSpec",
           "UsageError", "command_spec", "refuse_keywords"]

DEFAULT_TASK = "headloc_induction"
#: --masks and --confirm where neither is given and the run has no prior.
NO_PRIOR_MASKS, NO_PRIOR_ALONE = default_split(None)
#: --max-masks: where --masks auto stops when no top-k head settles.
DEFAULT_MAX_MASKS = 300
#: Bootstrap refits are a few ms each on a small model, seconds on a large design: more
#: than this would keep a run fitting for hours after its last measurement.
MAX_BOOTSTRAP = 10_000

# Fields a command may change on a run folder it resumes (everything else that is not
# runtime must match): locate's ranking can be refitted, greedy's top-k only trims files.
# locate's masks too: a design's first M rows are the M-mask design, so more masks extend
# a run and refit can fit on fewer; and its --confirm, whose picks do not depend on the
# budget, so a larger one measures only what is new (refit measures nothing: not there).
_REFITTABLE: dict[str, frozenset[str]] = {
    "locate": frozenset({"alpha", "top_k", "exclude", "bootstrap", "masks", "max_masks",
                         "confirm", "group_tests", "max_measurements"}),
    "greedy": frozenset({"top_k"}),
    # verify's random sets are drawn in turn from one seeded generator: more draws keep
    # the first ones, so a larger --random-draws only measures the new sets.
    "verify": frozenset({"random_draws"}),
}


@dataclass(frozen=True)
class RunSpec:
    """Every option of a measuring run (see the module docstring)."""

    # --- what is measured ------------------------------------------------------------
    model_args: str | None = _option(
        None, "hf model_args, e.g. pretrained=meta-llama/Llama-3.1-8B,dtype=bfloat16 "
              "(default: the embedded SmolLM2-135M-Instruct)", metavar="ARGS")
    tasks: tuple[str, ...] = _option(
        (DEFAULT_TASK,), "comma-separated lm-eval tasks, each optionally TASK:METRIC; a "
                         "task YAML's path is its task (its folder is included)",
        parse=comma_list, metavar="TASKS")
    include_path: tuple[str, ...] = _option(
        (), "a folder of your own lm-eval task YAMLs (repeatable); our task_configs are "
            "always included", metavar="DIR")
    num_samples: int = _option(
        100, "examples per task, the same seeded subset in every measurement",
        parse=int, metavar="N", whole=True, min_val=1)
    seed: int = _option(0, "seed of the example subset and the design", parse=int,
                        whole=True, min_val=0)
    examples_part: str | None = _option(
        None, "take the examples from part K of N disjoint parts of each task's documents "
              "(a shuffle seeded by --seed, cut in N): runs on 1/2 and 2/2 share no "
              "example, for headloc-harness overlap", metavar="K/N")
    design_seed: int | None = _option(
        None, "seed of the masks alone, so designs can vary on the same examples "
              "(default: --seed)", parse=int, metavar="SEED", whole=True, min_val=0)
    apply_chat_template: bool | None = _option(
        None, "ask through the chat template (default: for generation tasks when the "
              "model has one)", switch=argparse.BooleanOptionalAction)
    num_fewshot: int | None = _option(
        None, "as lm-eval's --num_fewshot: examples in each prompt's few-shot context, for "
              "every task whose YAML does not fix it at 0 (default: each task's own)",
        parse=int, metavar="N", whole=True, min_val=0)
    system_instruction: str | None = _option(
        None, "as lm-eval's --system_instruction: a system prompt before every prompt (the "
              "chat template's system message where a task is asked through it, else text "
              "before the prompt)", metavar="TEXT")
    gen_kwargs: str | None = _option(
        None, "as lm-eval's --gen_kwargs: generation arguments of the generation tasks, "
              "key=value pairs joined by commas or a JSON object, e.g. "
              "max_gen_toks=256,temperature=0 (default: each task's own)", metavar="ARGS")
    signal: str = _option(
        "metric", "what each measurement scores: the task's metric (as lm-eval reports it) "
                  "or logprob, the mean log-likelihood of the gold answers (continuous; "
                  "generation tasks teacher-forced on their reference answer)",
        choices=SIGNALS)
    never_ablate: str | None = _option(
        None, "heads kept out of every mask, and so out of the ranking (L0H1+L2H3 or a head "
              "file, e.g. universal.json); a run of --components heads+neurons takes neurons "
              "too, one of --components neurons neurons only (L3N12, L3N*), which are then "
              "no candidate and in no group",
        metavar="HEADS|FILE")
    ablation: str = _option(
        "zero", "what a knocked-out head's output becomes: zero; mean, its mean over the "
                "reference set's tokens; resample, its output on another example of the "
                "reference set", choices=ABLATIONS)
    scale: float = _option(
        0.0, "knocked-out heads' outputs become replacement + S x (output - replacement): 0 "
             "replaces them, 2 amplifies (with --ablation zero: the output doubled); 1, "
             "which leaves them as they are, is refused", parse=float, metavar="S",
        whole=False)
    ablation_data: str | None = _option(
        None, "reference set of --ablation mean or resample: a text file (one example per "
              "line), a JSONL file (its text field) or an lm-eval task (default: the run's "
              "tasks on its example subset)", metavar="FILE|TASK")
    ablation_field: str | None = _option(
        None, "with a JSONL --ablation-data: the field that holds each example's text "
              "(default: text)", metavar="FIELD")
    # --- locate's design ---------------------------------------------------------------
    components: str = _option(
        "heads", "what is located: attention heads, MLP neurons (L3N1234: the attribution "
                 "prior picks --candidates of the model's neurons, which the masks and the "
                 "confirmation then search as they search heads), or both",
        choices=COMPONENTS)
    candidates: int | str = _option(
        "auto", "with neurons: the neurons the prior's rankings name first that get a "
                "column in the design (auto: as many as the model has heads, so the "
                "default budget covers them as it covers the heads)",
        parse=parse_candidates, metavar="C")
    neuron_groups: int = _option(
        0, "with neurons: also cut each layer's neurons outside the candidates into G "
           "groups, one design column each (a mask knocks out the whole group), so a "
           "neuron the prior passed over still shows, through its group (0: none)",
        parse=int, metavar="G", whole=True, min_val=0)
    probe_rows: int = _option(
        PROBE_ROWS, "rows of the head-type probe (random tokens repeated twice): more rows, "
                    "fewer heads too near a type's threshold to be labelled", parse=int,
        metavar="N", whole=True, min_val=2, max_val=MAX_PROBE_ROWS,
        legacy=4)  # 4: the rows before the option
    design: str = _option("stratified", "how masks are drawn", choices=DESIGNS)
    # --masks and --confirm: None is the default budget's split for the run's prior
    # (budget.default_split), or on a resumed run the run's own (RunSpec.budgeted).
    masks: int | str | None = _option(
        None,
        "measurements (masks) in the design; rerun with more to extend a run, refit "
            "with fewer to see it shorter; auto: measure in rounds until every top-k head "
            "is stable in the bootstrap (or --max-masks) (default: "
            f"{DEFAULT_MASKS} with an attribution prior, {NO_PRIOR_MASKS} without one, "
            f"{ALL_ALONE_MASKS} where a default run measures every head alone (see "
            "--confirm); a resumed run keeps its own)", parse=parse_masks, metavar="M")
    max_masks: int = _option(DEFAULT_MAX_MASKS, "with --masks auto: the most masks measured",
                             parse=int, metavar="M", whole=True, min_val=1)
    sparsity: float | str = _option(
        0.1, "fraction of heads knocked out per mask; auto: the largest of 0.02, 0.05, "
              "0.1, 0.2 whose pilot masks stay clear of the score's floor (the pilot's "
              "masks count towards --masks and join the fit)", parse=parse_sparsity,
        metavar="P")
    prior: str = _option(
        "auto", "atp: attribution patching of the logprob signal (one forward + backward "
                "pass) eases the Lasso penalty of heads it finds harmful, never excluding "
                "any, and its ranking takes turns with the masks' in naming --confirm's "
                "candidates; atp-path: the same, and a second pass with every head half "
                "ablated, whose ranking takes a turn too (it sees heads whose effect the "
                "clean run's gradient hides); ig: integrated gradients, the attribution "
                "averaged over 8 points of the path to every head ablated (8 passes); "
                "saved as prior.json and ranked in the report; "
                "auto: atp-path where the tasks have gold answers and the model is "
                "decoder-only, else none; none too where every head is measured alone",
        choices=PRIORS, legacy="none")
    confirm: int | None = _option(
        None,
        "after the masks, knock out this many heads one at a time, in rounds of 5: "
            "the prior's rankings and the masks' fit (redone after each round with the "
            "measured heads held fixed) name one each in turn; those that hurt rank first, "
            "by what they measured (0: rank by the fit alone; rerun with more to measure "
            f"more) (default: {DEFAULT_ALONE} with an attribution prior, {NO_PRIOR_ALONE} "
            "without one; on a model of up to "
            f"{ALL_ALONE_UP_TO} heads, with none of --masks, --group-tests and "
            "--max-measurements given, every head it ranks, after "
            f"{ALL_ALONE_MASKS} masks: the default plan could not be certified under the "
            "automatic cap there; a resumed run keeps its own)",
        parse=int, metavar="N", whole=True, min_val=0, max_val=MAX_COUNT, legacy=0)
    group_tests: int | None = _option(
        None,
        "after --confirm, at most this many more measurements knock out the heads not "
            "measured alone together in small groups, those the fit implicates first, then "
            "those the masks covered least; a group that is not clearly under a task's "
            "top-k entry bar (the k-th measured harm) is halved until the heads behind it "
            "are measured alone; report.md's certificate says what the groups ruled out "
            "(default: until every head is measured alone or ruled out — the run is "
            "certified — or --max-measurements is reached; rerun with more to test more; a "
            "resumed run keeps its own)",
        parse=int, metavar="N", whole=True, min_val=0, max_val=MAX_COUNT, legacy=0)
    max_measurements: int | str | None = _option(
        None,
        "the most measurement-equivalents a run spends: the prior's allowance, the masks, "
            "the heads measured alone and the group tests (the baseline aside); the group "
            "tests stop there if the run is not certified by then, and the report says "
            "what is left unchecked (default auto: half the heads the run ranks, "
            f"{AUTO_CAP_SHARE:.0%} of one-shot greedy's cost; on a model of up to "
            f"{ALL_ALONE_UP_TO} heads a default run measures every head alone instead (see "
            "--confirm), and one given --masks or --confirm spends what the prior, masks "
            "and heads measured alone take, with no group test; rerun with more to go on; "
            "a resumed run keeps its own)",
        parse=parse_max_measurements, metavar="M")
    # --- ranking -----------------------------------------------------------------------
    alpha: float = _option(0.01, "Lasso penalty (on standardised scores)", SETTING,
                           parse=float, whole=False, min_val=0, include_boundaries="neither")
    top_k: int = _option(5, "heads reported (and knocked out by verify and cross)", SETTING,
                         parse=int, metavar="K", whole=True, min_val=1)
    exclude: str | None = _option(
        None, "heads kept out of the ranking (L0H1+L2H3 or a head file); a run of "
              "--components heads+neurons takes neurons too, one of --components neurons "
              "neurons only (L3N12)", SETTING, metavar="HEADS|FILE")
    bootstrap: int = _option(
        200, "refits on resampled measurements that give each head's stability (how "
             "often it makes the top-k) and its effect's 95 % interval", SETTING,
        parse=int, metavar="B", whole=True, min_val=1, max_val=MAX_BOOTSTRAP)
    # --- greedy ------------------------------------------------------------------------
    rounds: int = _option(1, "1: one-shot greedy (N measurements); K: iterative, K*N",
                          parse=int, metavar="K", whole=True, min_val=1)
    # --- verify ------------------------------------------------------------------------
    general: tuple[str, ...] | None = _option(
        None, "general tasks for the Gen drop (default: hellaswag,boolq,arc_challenge,mmlu; "
              "for the embedded model, which runs offline, the headloc_induction, "
              "headloc_ioi and headloc_arith tasks that are not the run's own)",
        parse=comma_list, metavar="TASKS")
    limit: int | None = _option(None, "examples per task (default: full datasets)",
                                parse=int, metavar="N", whole=True, min_val=1)
    random_draws: int = _option(
        5, "distinct random sets as large as each task's top-k, of the same kind, drawn (seeded by "
           "the run's --seed) from the components outside it and outside --exclude and "
           "--never-ablate, each knocked out like it: what its drop is compared with (0: "
           "none; rerun with more to add draws)", parse=int, metavar="R", whole=True,
        min_val=0)
    # --- how, not what -------------------------------------------------------------------
    batch_size: int | str | None = _option(
        None, "batch size: a number, 'auto' or 'auto:N' (default: 32, but a generation task "
              "on a GPU puts all its examples in one batch where memory allows, as auto)",
        RUNTIME, parse=parse_batch_size, metavar="N")
    masks_per_pass: int | None = _option(
        None, "masks evaluated together in one forward pass, or one generate call for "
              "greedy generation (default: from free memory on a GPU, halved for the rest of "
              "the run if a pass runs out of it; on a CPU 1 per forward pass and enough per "
              "generate call to fill it to 128 rows; config.json records it)", RUNTIME,
        parse=int,
        metavar="K", whole=True, min_val=1)
    workers: int = _option(
        1, "measure on N Ray workers, each loading the model once (a local Ray unless "
           "--ray-address; needs pip install 'lm-eval-headloc[ray]')", RUNTIME, parse=int,
        metavar="N", whole=True, min_val=1)
    ray_address: str | None = _option(
        None, "with --workers: join this Ray cluster (e.g. auto, or HOST:6379 from ray "
              "start --head)", RUNTIME, metavar="ADDR")
    ray_timeout: float = _option(
        RAY_TIMEOUT, "with --ray-address: seconds the address may take to answer; checked "
                     "before the model loads, it ends the run in one line if nothing "
                     "answers", RUNTIME, parse=float, metavar="SECONDS", whole=False,
        min_val=0, max_val=86400, include_boundaries="right")  # a thread's wait must fit
    gpus_per_worker: float | None = _option(
        None, "with --workers: GPUs per worker (default 1 where CUDA is available, else 0; "
              "more than 1 spreads the model over them with parallelize=True on one node)",
        RUNTIME, parse=float, metavar="G", whole=False, min_val=0)
    confirm_run_unsafe_code: bool = _option(
        False, "allow tasks that execute model-written code (mbpp, humaneval)", RUNTIME,
        switch="store_true")
    verbose: bool = _option(False, "show lm-eval's per-measurement logging", RUNTIME,
                            switch="store_true")
    output_path: str | None = _option(
        None, "as lm-eval's --output_path: also evaluate each knockout with lm-eval itself "
              "and write its results file there (results_<date>.json in a folder named "
              "for the model and what was knocked out)", RUNTIME, metavar="DIR")
    log_samples: bool = _option(
        False, "as lm-eval's --log_samples: with --output-path, also each document's "
               "sample (samples_<task>_<date>.jsonl)", RUNTIME, switch="store_true")
    progress: bool = _option(True, "show progress bars", RUNTIME)  # Python API only

    def __post_init__(self) -> None:
        # numpy's numbers (a notebook's np.int64(100)) as Python's: config.json's writing
        # failed on them after the model had loaded.
        for spec_field in fields(self):
            object.__setattr__(self, spec_field.name, as_python(getattr(self, spec_field.name)))
        # Sequences become tuples, so a spec is hashable and compares by value; a string
        # is a comma-separated list (one folder for include_path).
        for name in ("tasks", "include_path", "general"):
            value = getattr(self, name)
            if name == "include_path" and isinstance(value, (str, os.PathLike)):
                value = (value,)  # one folder
            elif isinstance(value, str):
                value = comma_list(value)
            elif value is not None and not isinstance(value, Iterable):  # tasks=5
                raise UsageError(f"{flag_of(name)} {value!r}: give names, comma-separated "
                                 "or as a list")
            if value is not None:
                object.__setattr__(self, name, tuple(_text_of(v) for v in value))
        # A notebook's Path objects as the text the command line gives: config.json's
        # writing failed on them ("Object of type PosixPath is not JSON serializable").
        for name in ("output_path", "ablation_data"):
            object.__setattr__(self, name, _text_of(getattr(self, name)))
        object.__setattr__(self, "gen_kwargs", canonical_gen_kwargs(self.gen_kwargs))
        # Components given as a list (a notebook's ["L0H1", Head(2, 3)]) are the names the
        # command line would give: one '+'-joined string, as config.json records it.
        for name in ("exclude", "never_ablate"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, "+".join(
                    _component_name(c, flag_of(name)) for c in value) or None)

    # --- construction ------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def runtime_fields(cls) -> frozenset[str]:
        """The fields that change how a run goes, never what it measures (batch size,
        masks per pass, workers, progress bars…)."""
        return frozenset(f.name for f in fields(cls) if f.metadata["role"] == RUNTIME)

    @staticmethod
    def refittable(command: str) -> frozenset[str]:
        """The fields ``command`` may change on a run folder it resumes (refit's)."""
        return _REFITTABLE.get(command, frozenset())

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, **overrides: Any) -> RunSpec:
        """The spec of a parsed command line (flags it does not have keep the defaults)."""
        given = {name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)}
        return cls(**{**given, **overrides})

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RunSpec:
        """The spec a run folder's config.json recorded."""
        # Folders made before config.json held the whole spec: identity + settings.
        # A field the folder does not record did not exist yet: what it did then.
        recorded = {**cls.assumed_for_old_runs(), **config.get("identity", {}),
                    **config.get("settings", {}), **config.get("spec", {})}
        return cls(**{k: v for k, v in recorded.items() if k in cls.field_names()})

    @property
    def design_rows(self) -> int:
        """Masks in the design: ``masks``, or ``max_masks`` for ``masks="auto"`` (after
        ``budgeted``: a spec with no ``masks`` has no design yet)."""
        if self.masks is None:
            raise ValueError("masks=None: the run's prior decides it (RunSpec.budgeted)")
        return self.max_masks if self.masks == "auto" else self.masks

    @property
    def budget_given(self) -> bool:
        """Whether ``masks`` and ``confirm`` are both set (given, or ``budgeted``)."""
        return self.masks is not None and self.confirm is not None

    def keeping_budget(self, stored: RunSpec) -> RunSpec:
        """This spec with ``masks`` and ``confirm`` that are None (left out) taken from
        ``stored``, each where it has one: a run stopped before its budget was split
        stored only what was given, and a bare rerun keeps that."""
        return self.replace(**{name: getattr(stored, name)
                               for name in ("masks", "confirm", "group_tests",
                                            "max_measurements")
                               if getattr(self, name) is None
                               and getattr(stored, name) is not None})

    def budgeted(self, prior: str | None, stored: RunSpec | None = None) -> RunSpec:
        """This spec with ``masks`` and ``confirm`` set where they are None: ``stored``'s
        (the run being resumed: a rerun without them keeps what it measured), else the
        default budget's split for ``prior``, the prior the run computes (``None``: none;
        ``budget.default_split``)."""
        spec = self if stored is None else self.keeping_budget(stored)
        masks, alone = default_split(prior)
        return spec.replace(masks=masks if spec.masks is None else spec.masks,
                            confirm=alone if spec.confirm is None else spec.confirm)

    def measuring_all_alone(self, heads: int, ranked: int | None = None) -> RunSpec:
        """This spec measuring each of the ``ranked`` heads (default: all ``heads``, the
        model's, whose half is the automatic cap) alone after the fewest masks the fit
        takes, where it is a default run that should (``budget.measures_all_alone``: models
        of up to 108 heads): a heads run with none of --masks, --confirm, --group-tests and
        --max-measurements given and a fixed --sparsity (auto's pilot takes more masks);
        else this spec."""
        if (self.components != "heads" or self.sparsity == "auto"
                or any(value is not None for value in (self.masks, self.confirm,
                                                       self.group_tests,
                                                       self.max_measurements))
                or not measures_all_alone(heads)):
            return self
        return self.replace(masks=ALL_ALONE_MASKS, confirm=heads if ranked is None else ranked)

    def measurement_cap(self, columns: int) -> int:
        """``max_measurements`` as a number, for a run ranking ``columns`` components."""
        return measurement_cap(self.max_measurements, columns)

    def fixed_part(self, allowance: int, alone_at_most: int | None = None) -> int:
        """What the run measures whatever it finds (``budget.fixed_part``): 0 where its
        confirmation is not decided. ``alone_at_most``: as for ``check_cap``."""
        return 0 if self.confirm is None else fixed_part(
            self.masks, self._alone(alone_at_most), allowance)

    def check_cap(self, allowance: int, *, prior_known: bool = True,
                  alone_at_most: int | None = None) -> None:
        """Refuse a numeric ``max_measurements`` below the run's fixed part
        (``budget.cap_refusal``; ``prior_known`` False: the prior not decided yet, so
        any allowance it has comes on top). ``alone_at_most``: the components the run
        can measure alone, where known (the heads a heads run ranks): the confirmation
        measures no more than those."""
        if self.max_measurements in (None, "auto") or self.confirm is None:
            return
        refusal = cap_refusal(int(self.max_measurements), self.masks,
                              self._alone(alone_at_most), allowance, prior_known)
        if refusal:
            raise UsageError(refusal)

    def _alone(self, alone_at_most: int | None) -> int:
        assert self.confirm is not None
        return int(self.confirm) if alone_at_most is None else min(int(self.confirm),
                                                                   alone_at_most)

    def check_group_tests(self) -> None:
        """Refuse ``--group-tests`` with no heads measured alone (``--confirm 0``, given or
        kept from the run resumed): group tests follow a confirmation."""
        if self.group_tests and self.confirm == 0:
            raise UsageError(f"--group-tests {self.group_tests}: group tests look for what "
                             "the heads measured alone left out; give --confirm N > 0 too "
                             "(or leave --confirm out for the default)")

    @property
    def masks_seed(self) -> int:
        """The seed the design (and its bootstrap) is drawn with."""
        return self.seed if self.design_seed is None else self.design_seed

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)

    # --- checks --------------------------------------------------------------------------

    def validate(self) -> RunSpec:
        """Check every value that can be checked without the model; returns self."""
        for spec_field in fields(self):
            value = getattr(self, spec_field.name)
            flag = flag_of(spec_field.name)
            meta = spec_field.metadata
            if meta["number"] is not None and value is not None:
                check_number(value, flag, **meta["number"])
            if meta["choices"] is not None and value not in meta["choices"]:
                raise UsageError(f"{flag} {value!r}: must be one of {', '.join(meta['choices'])}")
            if meta["switch"] is not None and value not in (None, True, False):
                raise UsageError(f"{flag} {value!r}: must be True or False")
        if not isinstance(self.progress, bool):  # "no" would draw the bars regardless
            raise UsageError(f"progress={self.progress!r}: must be True or False")
        if not self.tasks:
            raise UsageError("--tasks is empty; name at least one task (e.g. gsm8k)")
        if isinstance(self.tasks, (str, bytes)) or not all(
                isinstance(task, str) and task.strip() for task in self.tasks):
            raise UsageError(f"tasks={self.tasks!r}: must be a list of task names "
                             "(e.g. ['gsm8k'])")
        for name in ("masks", "max_measurements", "candidates", "sparsity", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip().startswith("auto"):
                # The CLI reads its flags' text; from Python a number is given as one.
                raise UsageError(f"{name}={value!r}: give a number, not its text, or 'auto'")
        if self.general is not None and not self.general:
            raise UsageError("--general is empty; name at least one task or leave it out")
        if self.batch_size is not None:
            parse_batch_size(self.batch_size)
        if self.masks is not None:
            parse_masks(self.masks)
        parse_sparsity(self.sparsity)
        if self.max_measurements is not None:
            parse_max_measurements(self.max_measurements)
        parse_candidates(self.candidates)
        parse_examples_part(self.examples_part)
        parse_gen_kwargs(self.gen_kwargs)
        if parse_candidates(self.candidates) != "auto" and "neurons" not in self.components:
            raise UsageError(f"--candidates {self.candidates}: the candidates are MLP "
                             "neurons; add --components neurons or heads+neurons")
        if self.neuron_groups and "neurons" not in self.components:
            raise UsageError(f"--neuron-groups {self.neuron_groups}: groups are of MLP "
                             "neurons; add --components neurons or heads+neurons")
        # --max-measurements against the run's fixed part is checked by locate, which
        # knows the heads a confirmation can measure (--confirm 20 on 8 heads measures 8).
        self.check_group_tests()
        if "neurons" in self.components and self.prior == "none":
            raise UsageError(f"--components {self.components} needs the attribution prior "
                             "(--prior auto, atp, atp-path or ig): the masks, too few for every "
                             "neuron, search the ones it names first")
        if self.output_path is not None:
            if not isinstance(self.output_path, str):
                raise UsageError(f"--output-path {self.output_path!r}: must be a path")
            where = Path(self.output_path)
            if not str(self.output_path).strip():
                raise UsageError("--output-path '': give a folder for lm-eval's results files")
            # lm-eval writes into a folder, or beside a .json file name (never into it).
            if where.exists() and not where.is_dir() and where.suffix != ".json":
                raise UsageError(f"--output-path {self.output_path}: exists and is not a "
                                 "folder; lm-eval writes its results files into a folder")
        if self.log_samples and self.output_path is None:
            raise UsageError("--log-samples: give --output-path too (the samples are written "
                             "there, as lm-eval does)")
        if self.ablation_data is not None and self.ablation == "zero":
            raise UsageError(f"--ablation-data {self.ablation_data!r}: a reference set is for "
                             "--ablation mean or resample; zero ablation uses none")
        if self.ablation_field is not None and self.ablation_data is None:
            raise UsageError(f"--ablation-field {self.ablation_field!r}: names a field of a "
                             "JSONL --ablation-data; give that file too")
        for name in ("model_args", "never_ablate", "exclude", "ablation_data",
                     "ablation_field", "ray_address", "system_instruction"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise UsageError(f"{flag_of(name)} {value!r}: must be a string")
        # Empty means "the default" only when left out: '' is a mistake, not the embedded
        # model or the current folder.
        if self.model_args is not None and not self.model_args.strip():
            raise UsageError("--model-args '': give pretrained=<model> (or leave it out for "
                             "the embedded SmolLM2)")
        for name in ("never_ablate", "exclude"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise UsageError(f"{flag_of(name)} '': give components (L0H1+L2H3) "
                                 "or a head file, or leave it out for none")
        if "heads" not in self.components.split("+"):
            for name in ("exclude", "never_ablate"):
                if getattr(self, name) is not None:
                    self._refuse_heads(name)
        if self.model_args is not None:
            check_model_args(self.model_args)
        if self.system_instruction is not None and not self.system_instruction.strip():
            raise UsageError("--system-instruction '': give the instruction's text, or leave "
                             "it out for none")
        if self.ablation_data is not None and not self.ablation_data.strip():
            raise UsageError("--ablation-data '': give a file or a task, or leave it out for "
                             "the run's tasks")
        if any(not str(folder).strip() for folder in self.include_path):
            raise UsageError("--include-path '': give a folder of task YAMLs")
        return self

    def _refuse_heads(self, name: str) -> None:
        """Refuse an attention head in ``name``'s components (--exclude, --never-ablate) of
        a run that locates MLP neurons only: no mask knocks a head out and none is ranked,
        so the head would be silently ignored (a heads run refuses a neuron the same way,
        ``setup.head_list``). Names that are malformed, or a head file that cannot be
        read, are left to ``head_list``, which says why with the model's ranges."""
        from lm_eval_headloc.intervention.components import (
            ComponentSpecError,
            check_component_names,
            names_a_file,
            read_heads_file,
        )

        value = getattr(self, name)
        flag = flag_of(name)
        try:
            names = read_heads_file(Path(value)) if names_a_file(value) else value
            check_component_names(names)
        except ComponentSpecError:
            return
        try:
            check_component_names(names, heads=False)
        except ComponentSpecError as err:
            raise UsageError(f"{flag} {value}: {err}: the run's --components "
                             f"{self.components} locates MLP neurons only, where no head is "
                             "knocked out or ranked (heads are kept out by a run with "
                             "--components heads or heads+neurons)") from None

    # --- identity ----------------------------------------------------------------------

    def identity(self, command: str) -> dict[str, Any]:
        """The fields that define ``command``'s measurements, as JSON values: a run folder
        made with other values is refused rather than resumed. Those are the fields every
        measuring command shares and ``command``'s own options (``COMMAND_OPTIONS``):
        locate's design does not make a greedy run's measurements, so a changed default
        of ``--masks`` does not refuse a greedy folder."""
        refittable = self.refittable(command)
        used = {*_MEASURING, *COMMAND_OPTIONS.get(command, ())}
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)
                if f.metadata["role"] != RUNTIME and f.name not in refittable
                and f.name in used}

    @classmethod
    def assumed_for_old_runs(cls) -> dict[str, Any]:
        """What a run folder made before a field existed was made with, per field, as JSON
        values (``RunFolder.start``'s ``assumed``): its default, or for a field whose
        default does something new (``confirm``, ``prior``) the value that does not."""
        return {f.name: _jsonable(f.metadata["legacy"]) for f in fields(cls)}

    def settings(self, command: str) -> dict[str, Any]:
        """The fields ``command`` may change when it resumes (``refit``'s)."""
        return {name: _jsonable(getattr(self, name))
                for name in sorted(self.refittable(command))}

    def as_config(self) -> dict[str, Any]:
        """Every field, for config.json (``from_config`` reads it back)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}


def _component_name(component: Any, flag: str) -> str:
    """A listed component as its name: a name as given (``L3H*`` is one), a Head, a Neuron
    or a (layer, head) pair as ``format_heads`` writes it; str() made a pair the name
    "(0, 1)", refused later as a bad head name."""
    if isinstance(component, str):
        return component
    from lm_eval_headloc.intervention.components import ComponentSpecError, format_heads

    try:
        return format_heads([component])
    except ComponentSpecError as err:
        raise UsageError(f"{flag}: {err}") from None


def _text_of(value: Any) -> Any:
    """A path (``os.PathLike``) as its text; anything else as it is."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# --- the command line ------------------------------------------------------------------

# The RunSpec fields each subcommand takes on the command line.
_MEASURING = ("model_args", "tasks", "include_path", "num_samples", "seed", "examples_part",
              "apply_chat_template", "num_fewshot", "system_instruction", "gen_kwargs",
              "signal", "never_ablate",
              "ablation", "scale", "ablation_data", "ablation_field", "exclude", "top_k",
              "batch_size", "masks_per_pass",
              "workers", "ray_address", "ray_timeout", "gpus_per_worker",
              "confirm_run_unsafe_code", "verbose")
COMMAND_OPTIONS: dict[str, tuple[str, ...]] = {
    "locate": _MEASURING + ("components", "candidates", "neuron_groups", "design",
                            "design_seed", "masks", "max_masks", "sparsity", "prior",
                            "confirm", "group_tests", "max_measurements", "alpha",
                            "bootstrap"),
    "greedy": _MEASURING + ("rounds",),
    # sweep's --masks and --sparsity are grids (lists), added by the sweep command.
    "sweep": _MEASURING + ("components", "candidates", "neuron_groups", "design",
                           "design_seed", "prior", "confirm", "alpha", "bootstrap"),
    # verify's ablation flags default to the run's (add_options(keep_stored=True)).
    "verify": ("top_k", "general", "limit", "random_draws", "batch_size", "workers",
               "ray_address", "ray_timeout", "gpus_per_worker", "confirm_run_unsafe_code",
               "verbose", "output_path", "log_samples"),
    # cross takes the model from its runs, and its --tasks defaults to theirs (the CLI
    # adds it with add_options(keep_stored="the runs' own tasks")).
    # cross's prompt options default to its runs' (add_options(keep_stored=...)).
    "cross": ("include_path", "num_samples", "seed", "ablation",
              "scale", "ablation_data", "ablation_field", "top_k", "batch_size",
              "masks_per_pass", "workers", "ray_address", "ray_timeout", "gpus_per_worker",
              "confirm_run_unsafe_code", "verbose", "output_path", "log_samples"),
    "types": ("model_args", "tasks", "include_path", "num_samples", "seed", "examples_part",
              "apply_chat_template", "num_fewshot", "system_instruction", "probe_rows",
              "batch_size", "confirm_run_unsafe_code", "verbose"),
    # max_masks may change when a run resumes, but refit measures nothing.
    "refit": tuple(sorted(_REFITTABLE["locate"] - {"max_masks", "confirm", "group_tests",
                                                   "max_measurements"})),
}


def command_spec(command: str, spec: RunSpec | None, options: Mapping[str, Any],
                 also: Iterable[str] = (), base: RunSpec | None = None) -> RunSpec:
    """``spec`` (default ``base``, else a new RunSpec) with ``options``, the keywords of
    ``command``'s Python function: its flags' fields (``COMMAND_OPTIONS``), ``also`` and
    ``progress``. Another name is a TypeError naming the ones it takes: dropped silently,
    a notebook's ``verify(run, num_samples=8)`` would seem to have applied."""
    if spec is not None and not isinstance(spec, RunSpec):
        raise TypeError(f"{command}(): spec={spec!r} is not a RunSpec; give the options as "
                        "keywords, or RunSpec(**options)")
    refuse_keywords(command, options, {*COMMAND_OPTIONS[command], *also, "progress"})
    return (spec or base or RunSpec()).replace(**options)
