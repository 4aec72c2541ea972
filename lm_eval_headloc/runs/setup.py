"""What a measuring run knows before its model loads: ``prepare`` → ``Setup``.

``prepare`` does everything that can be done without the weights (the model's config,
the tasks built once, every head list checked against the model), so a bad argument
fails before the user waits for the model (``runs.plan`` then loads and measures).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.errors import one_line
from lm_eval_headloc.common.timing import timed
from lm_eval_headloc.distributed.workers import check_workers
from lm_eval_headloc.intervention.ablation import (
    FLOAT32_OVERFLOW,
    AblationError,
    check_reference_set,
    reference_texts,
    scale_overflow,
)
from lm_eval_headloc.intervention.components import (
    Component,
    ComponentSpecError,
    Head,
    Neuron,
    names_a_file,
    parse_components,
    parse_heads,
    read_heads_file,
)
from lm_eval_headloc.intervention.geometry import Geometry
from lm_eval_headloc.intervention.model_args import (
    check_chat_template,
    config_geometry,
    context_length,
    model_config,
    model_fingerprint,
    resolve_model_args,
)
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.measurement.harness import choose_subset
from lm_eval_headloc.measurement.metrics import (
    TASK_METRICS,
    MetricError,
    default_metric,
    metrics_of_task,
    parse_task_metric,
    tag_advice,
    tag_metric,
)
from lm_eval_headloc.measurement.signals import check_gold_answers
from lm_eval_headloc.method.columns import Columns
from lm_eval_headloc.method.designs import MAX_DESIGN_BYTES
from lm_eval_headloc.runs.folder_checks import names_task_file
from lm_eval_headloc.runs.option_values import parse_examples_part, parse_gen_kwargs, path_list
from lm_eval_headloc.runs.spec import RunSpec
from lm_eval_headloc.tasks import check_task_names, load_failure, make_task_manager

__all__ = ["NoEffectError", "Setup", "check_candidates", "check_design_budget",
           "check_scale_fits", "check_task_overrides", "head_list", "prepare"]

log = logging.getLogger("lm_eval_headloc")



@dataclass
class Setup:
    """What a subcommand knows before loading the model."""

    spec: RunSpec  # resolved: model_args complete, tasks re-joined, include paths absolute
    tasks: list[tuple[str, str | None]]  # (task, metric or None)
    geometry: Geometry  # from the model's config: layers, heads, MLP width (None: unsaid)
    loaded: dict[str, Any]  # task name -> lm-eval's TaskManager.load result, built once
    exclude: list[Component]  # MLP neurons only in a run that locates them
    never_ablate: list[Component]
    # Mean/resample's reference examples when --ablation-data names them; None: the run's
    # own tasks on its example subset, taken once the measurement has chosen it.
    reference: list[str] | None = None
    # What identifies a model loaded from a local folder (``model_fingerprint``).
    model_fingerprint: str | None = None

    # The counts callers read from before the Setup held the whole geometry.
    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def heads_per_layer(self) -> int:
        return self.geometry.heads_per_layer

    @property
    def total_heads(self) -> int:
        return self.geometry.total_heads

    @property
    def rankable_heads(self) -> int:
        """The heads a heads run ranks: every head but those --exclude and --never-ablate
        name."""
        return self.heads_ranked_with(self.exclude)

    def heads_ranked_with(self, exclude: str | Sequence[Component] | None) -> int:
        """The heads a heads run with this --never-ablate ranks under another --exclude
        (a stored run's: names, or a head file, read as ``head_list`` reads it)."""
        if exclude is None or isinstance(exclude, str):
            g = self.geometry
            exclude = head_list(exclude, g.num_layers, g.heads_per_layer, "--exclude",
                                head_layers=g.head_layers)
        return _heads_ranked(self.total_heads, exclude, self.never_ablate)

    def checked(self, names: Iterable[str | Component]) -> list[Component]:
        """``names`` (heads and MLP neurons) checked against the model's config before the
        weights load: a set from another model fails in seconds. Neurons are checked
        against the MLP's width where the config gives it, else once the model loads."""
        g = self.geometry
        return parse_components(list(names), g.num_layers, g.heads_per_layer,
                                g.neurons_per_layer, head_layers=g.head_layers)

    @property
    def task_names(self) -> list[str]:
        return [name for name, _ in self.tasks]

    @property
    def run_task_names(self) -> list[str]:
        """The run's own tasks (``task_names`` less verify's general tasks)."""
        return self.task_names[:len(self.spec.tasks)]

    def reference_texts(self, subset: Mapping[str, list[int]] | None) -> list[str]:
        """Mean/resample's reference examples: --ablation-data's, else the prompts of the
        run's own tasks on ``subset``."""
        from lm_eval_headloc.intervention.ablation import task_texts

        if self.reference is not None:
            return self.reference
        return [text for name in self.run_task_names
                for text in task_texts(self.loaded[name]["tasks"], subset)]


def _heads_ranked(total: int, exclude: Iterable[Component], never: Iterable[Component]
                  ) -> int:
    """The heads of a model of ``total`` that a heads run ranks: all but those --exclude
    and --never-ablate name (their neurons aside)."""
    return total - len({h for h in (*exclude, *never) if isinstance(h, Head)})


def head_list(spec: str | None, num_layers: int, heads_per_layer: int, what: str, *,
              neurons: bool = False, neurons_per_layer: int | None = None,
              head_layers: Sequence[int] | None = None) -> list[Component]:
    """Heads from ``L0H1+L2H3`` or a head file (JSON / one per line), checked against the
    model (a hybrid's heads against its ``head_layers``); with ``neurons`` (a run that
    locates MLP neurons) neurons too, ``L3N12``, checked against ``neurons_per_layer``
    where known."""
    if not spec:
        return []
    names: Any = spec
    try:
        if names_a_file(spec):
            names = read_heads_file(Path(spec))  # a path: "not found", not "bad name"
        if not neurons:
            return list(parse_heads(names, num_layers, heads_per_layer,
                                    head_layers=head_layers))
        return parse_components(names, num_layers, heads_per_layer, neurons_per_layer,
                                head_layers=head_layers)
    except ComponentSpecError as err:
        hint = "" if neurons or not _names_a_neuron(names) else (
            " (neurons are kept out by a locate or sweep that locates them: --components "
            "neurons or heads+neurons)")
        raise UsageError(f"{what}: {err}{hint}") from None


def recorded_components(value: str | None) -> str | None:
    """What a run records of ``--exclude`` or ``--never-ablate`` ``value`` (``head_list``
    has read it): a head file's names as it lists them, not its path, which read from
    another working directory or machine (a refit, a resume, a verify) names another file
    or none; components given by name as given."""
    if value and names_a_file(value):
        return "+".join(read_heads_file(Path(value)))
    return value


def same_components(given: Any, stored: Any) -> bool:
    """Whether a run that recorded ``--exclude`` or ``--never-ablate`` as ``stored`` (a
    head file's path, as runs did before ``recorded_components``) kept out ``given``
    (names): the file, read as the run read it, lists them."""
    if given == stored:
        return True
    if not (isinstance(given, str) and isinstance(stored, str) and names_a_file(stored)):
        return False
    try:
        return recorded_components(stored) == given
    except ComponentSpecError:
        return False


def _names_a_neuron(names: Any) -> bool:
    try:
        return any(isinstance(c, Neuron) for c in parse_components(names))
    except ComponentSpecError:
        return False


def _join_metric_filters(parts: Sequence[str], known_tasks: Iterable[str]) -> list[str]:
    """["gsm8k:exact_match", "strict-match", "mmlu"] -> ["gsm8k:exact_match,strict-match",
    "mmlu"]: a part that is no task, right after a TASK:METRIC without a filter, is that
    metric's filter."""
    known, joined = set(known_tasks), []
    for part in parts:
        previous = joined[-1] if joined else ""
        if (":" in previous and "," not in previous.split(":", 1)[1] and ":" not in part
                and part not in known):
            joined[-1] = f"{previous},{part}"
        else:
            joined.append(part)
    return joined


_OFFLINE_HINT = ("lm-eval's built-in tasks download their data from the Hugging Face Hub; "
                 "offline, use the headloc_* tasks (headloc_induction, headloc_ioi, "
                 "headloc_arith) or your own with --include-path")


def _built_in(manager: Any, name: str) -> bool:
    """Whether task ``name`` is one of lm-eval's own (whose data comes from the Hub), not a
    YAML of ours or of the user's, whose failure the Hub does not explain."""
    import lm_eval.tasks

    entry = getattr(manager, "task_index", {}).get(name)
    path = getattr(entry, "yaml_path", None)
    if path is None:  # a tag, or an lm-eval without the index: say it
        return True
    return Path(lm_eval.tasks.__file__).resolve().parent in Path(path).resolve().parents


def tasks_from_files(tasks: Sequence[str]) -> tuple[list[str], list[str]]:
    """``--tasks`` as lm_eval takes them, a task YAML's path among names
    (``my_tasks/capitals.yaml``, ``…yaml:acc``): each path as the task it defines, and the
    folders holding them, which the run then includes (``--include-path``), so that it
    records task names and resumes the same from any working directory."""
    from lm_eval.tasks._yaml_loader import load_yaml

    names, folders = [], []
    for task in tasks:
        path_part, sep, metric = task.partition(":")
        if not names_task_file(task):
            names.append(task)
            continue
        path = Path(path_part.strip())
        if not path.is_file():
            raise UsageError(f"--tasks {task}: no such task file")
        try:
            config = load_yaml(str(path), resolve_func=False)
        except Exception as err:  # noqa: BLE001 — any unreadable YAML is the user's file
            raise UsageError(f"--tasks {task}: cannot read it ({one_line(err)})") from None
        # A task's file names it under task:; a group's under group: (its task: is the
        # list of its members).
        name = next((config[key] for key in ("task", "group") if isinstance(config, dict)
                     and isinstance(config.get(key), str)), None)
        if not isinstance(name, str):
            raise UsageError(f"--tasks {task}: the file names no task (no 'task:' or "
                             "'group:' key holding one name)")
        names.append(name + sep + metric)
        folders.append(str(path.resolve().parent))
    return names, folders


@timed("tasks and checks")
def prepare(spec: RunSpec, extra_tasks: Sequence[str] = (), *, generates: bool = True,
            ranks: bool = True) -> Setup:
    """Check the spec, the model (config only, no weights), the tasks (built once: names,
    metrics, whether they run model-written code) and every head list — all before any
    weights load. ``extra_tasks`` are measured too (verify's general tasks); ``generates``:
    whether the command runs the generation tasks (``types`` only reads their prompts);
    ``ranks``: whether its --top-k is of what this spec ranks (cross's is of its runs'
    rankings, of whatever components they rank, each checked against its file)."""
    spec.validate()
    own, own_folders = tasks_from_files(spec.tasks)
    extra_tasks, extra_folders = tasks_from_files(extra_tasks)
    spec = spec.replace(tasks=tuple(own), include_path=tuple(dict.fromkeys(
        [*spec.include_path, *own_folders, *extra_folders])))
    check_workers(spec.workers, spec.ray_address, spec.gpus_per_worker, spec.ray_timeout)
    # Task names first: a mistyped one is said in a second, before the model's config is
    # read (a GGUF file's takes seconds).
    try:
        manager = make_task_manager(list(spec.include_path))
        # Each list joined on its own: a filter after --tasks' last TASK:METRIC is not the
        # first of --general's tasks, nor the other way round.
        own_joined = _join_metric_filters(spec.tasks, manager.all_tasks)
        extra_joined = _join_metric_filters(extra_tasks, manager.all_tasks)
        joined = [*own_joined, *extra_joined]
        specs = [parse_task_metric(t) for t in joined]
        check_task_names(manager, [name for name, _ in specs])
    except ValueError as err:
        raise UsageError(str(err)) from None
    _check_named_once(own_joined, [name for name, _ in specs[:len(own_joined)]],
                      extra_joined, [name for name, _ in specs[len(own_joined):]])
    model_args = resolve_model_args(spec.model_args)
    config = model_config(model_args)
    if spec.scale == 1:  # replacement + 1 x (output - replacement): the output itself
        raise UsageError("--scale 1: a knocked-out head's output would stay as it is, so no "
                         "measurement could move the task; give 0 to knock heads out, or "
                         "another value to scale them")
    check_scale_fits(spec.scale, model_args, config)
    if spec.apply_chat_template:
        check_chat_template(model_args)
    geometry = config_geometry(config)
    num_layers, heads_per_layer = geometry.num_layers, geometry.heads_per_layer
    from lm_eval_headloc.measurement.harness import seed_as_lm_eval

    loaded = {}
    seed_as_lm_eval()
    for name, metric in specs:
        try:
            loaded[name] = manager.load([name])
        except Exception as err:  # noqa: BLE001 — a task whose data cannot be had
            said = load_failure(name, err)
            hint = (f" ({_OFFLINE_HINT})" if _built_in(manager, name)
                    and said.startswith("cannot load") else "")
            raise UsageError(f"{said}{hint}") from None
        leaves = loaded[name]["tasks"].values()
        # A tag, or a group that aggregates nothing (no score of its own), is the mean of
        # its tasks by one metric: one each of them produces.
        tag = _mean_of_its_tasks(name, loaded[name])
        produced_by = {leaf: set(metrics_of_task(task))
                       for leaf, task in loaded[name]["tasks"].items()}
        common = sorted(set.intersection(*produced_by.values())) if produced_by else []
        if metric is not None:
            produced = sorted(set().union(*produced_by.values()))
            if metric not in produced:
                raise UsageError(f"task {name!r} produces no metric {metric!r}; it produces: "
                                 f"{', '.join(produced)}")
            lacking = sorted(leaf for leaf, keys in produced_by.items() if metric not in keys)
            if tag and lacking:
                raise UsageError(f"--tasks {name}:{metric}: {name!r} is scored by the mean "
                                 f"of its tasks, and {', '.join(lacking)} "
                                 f"{'produces' if len(lacking) == 1 else 'produce'} no "
                                 f"{metric!r}; {tag_advice(name, common, sorted(produced_by))}")
        elif spec.signal == "metric" and name not in TASK_METRICS and tag:
            # The metric, decided here (refused here where the tasks' own differ).
            try:
                chosen = tag_metric(name, {task: default_metric(task, built) for task, built
                                           in loaded[name]["tasks"].items()}, common)
            except MetricError as err:
                raise UsageError(str(err)) from None
            specs[specs.index((name, None))] = (name, chosen)
        needs_gold = [flag for flag, wanted in (("--signal logprob", spec.signal == "logprob"),
                                                (f"--prior {spec.prior}",
                                                 spec.prior in PRIOR_POINTS),
                                                # its prior names the neurons it searches
                                                (f"--components {spec.components}",
                                                 "neurons" in spec.components)) if wanted]
        for flag in needs_gold:  # an output type without gold answers, or empty ones
            check_gold_answers(loaded[name]["tasks"], flag)
        if spec.signal == "logprob":
            if metric is not None:
                raise UsageError(f"--tasks {name}:{metric}: a metric is used only with "
                                 "--signal metric")
        if not spec.confirm_run_unsafe_code and any(getattr(t, "UNSAFE_CODE", False)
                                                    for t in leaves):
            raise UsageError(f"task {name!r} executes model-written code; rerun with "
                             "--confirm-run-unsafe-code if you accept that")
    check_task_overrides(spec, loaded, context_length(model_args, config), generates)
    resolved = spec.replace(model_args=model_args, tasks=tuple(own_joined),
                            include_path=tuple(path_list(spec.include_path)))
    total = geometry.total_heads
    columns = _column_count(spec, geometry)
    if ranks and spec.top_k > columns:
        raise UsageError(f"--top-k {spec.top_k}: the model has only {total} heads"
                         if spec.components == "heads" else
                         f"--top-k {spec.top_k}: the run ranks only {columns} components")
    exclude, never = (head_list(value, num_layers, heads_per_layer, flag,
                                neurons="neurons" in spec.components,
                                neurons_per_layer=geometry.neurons_per_layer,
                                head_layers=geometry.head_layers)
                      for value, flag in ((spec.exclude, "--exclude"),
                                          (spec.never_ablate, "--never-ablate")))
    resolved = resolved.replace(exclude=recorded_components(spec.exclude),
                                never_ablate=recorded_components(spec.never_ablate))
    excluded_heads = {h for h in exclude if isinstance(h, Head)}
    never_heads = {h for h in never if isinstance(h, Head)}
    if "heads" in spec.components.split("+") and len(excluded_heads | never_heads) >= total:
        which = ("--never-ablate covers" if len(never_heads) >= total else "--exclude covers"
                 if len(excluded_heads) >= total else
                 "--exclude and --never-ablate together cover")
        if spec.components != "heads":  # its neurons are left: ranking no head is another run
            raise UsageError(f"{which} every head ({total}); to rank MLP neurons alone, give "
                             "--components neurons")
        raise UsageError(f"{which} every head ({total}); nothing is left to rank")
    ranked = _heads_ranked(total, exclude, never)
    if ranks and spec.components == "heads" and spec.top_k > ranked:
        # A top-5 of 4 heads ran, and its report spoke of a top-5.
        raise UsageError(f"--top-k {spec.top_k}: the run ranks only {ranked} heads (the "
                         f"model's {total} less {total - ranked} in --exclude and "
                         "--never-ablate)")
    if "neurons" in spec.components:
        count, kept_out = _candidate_count(spec, geometry), sum(isinstance(c, Neuron)
                                                                 for c in never)
        check_candidates(count, geometry.total_neurons, kept_out)
        if spec.neuron_groups and geometry.total_neurons == count + kept_out:
            # Every neuron is a candidate (or never knocked out): the groups were ignored.
            raise UsageError(f"--neuron-groups {spec.neuron_groups}: --candidates {count} "
                             + (f"and --never-ablate's {kept_out} " if kept_out else "")
                             + f"take every one of the model's {geometry.total_neurons} MLP "
                             "neurons, leaving none to group; leave --neuron-groups out")
    # --masks left out is the default budget's split, which both checks below pass.
    if spec.masks is not None:
        check_design_budget(spec.design_rows, columns,
                            "--max-masks" if spec.masks == "auto" else "--masks")
    if spec.sparsity == "auto" and spec.components == "heads" and spec.masks is not None:
        from lm_eval_headloc.method.pilot import check_pilot_fits, pilot_design

        heads = Columns.heads(num_layers, heads_per_layer, geometry.head_layers)
        never_flat = [heads.index(h) for h in never]
        check_pilot_fits(spec.design_rows,
                         len(pilot_design(total, spec.masks_seed, never_flat)[0]), spec.masks)
    reference = None
    if spec.ablation != "zero" and spec.ablation_data is not None:
        try:
            reference = reference_texts(spec.ablation_data, spec.ablation_field,
                                        task_manager=manager)
            check_reference_set(spec.ablation, reference)
        except AblationError as err:
            raise UsageError(f"--ablation-data: {err}") from None
    return Setup(resolved, specs, geometry, loaded, exclude, never, reference,
                 model_fingerprint(model_args))


def _mean_of_its_tasks(name: str, entry: Mapping[str, Any]) -> bool:
    """Whether lm-eval reports no score of ``name``'s own (``entry``: what
    ``TaskManager.load`` built for it), so that it is measured as the mean of its tasks: a
    tag of several, or a group with no ``aggregate_metric_list`` whose subgroups, if any,
    have none either (the mean of its subgroups' means of their tasks)."""
    groups = entry["groups"]
    if not groups:
        return len(entry["tasks"]) > 1
    group = groups.get(name)
    return group is not None and not any(
        g.aggregate_metric_list for g in [group, *group.get_all_groups()])


def check_scale_fits(scale: float, model_args: str, config: Any) -> None:
    """Refuse a --scale that overflows the model's arithmetic (``ablation.scale_overflow``:
    inf as a float32 unless the model computes in float64): every knockout would be inf or
    NaN, found only once the model has loaded and measured."""
    from lm_eval_headloc.intervention.arg_string import ModelArgs

    args = ModelArgs.parse(model_args)
    runs_in = scale_overflow(scale, args.get("dtype"), config, args.get("mixed_precision_dtype"))
    if runs_in is not None:
        raise UsageError(f"--scale {scale:g}: beyond float32's range (from "
                         f"{FLOAT32_OVERFLOW:.7g} on, a float32 is inf); in the model's "
                         f"{runs_in} arithmetic every nonzero knocked-out output times it is "
                         "inf, so every measurement that knocks anything out would be NaN; "
                         "give a smaller --scale (or load the model with dtype=float64 in "
                         "--model-args)")


def _check_named_once(own: Sequence[str], own_names: Sequence[str], extra: Sequence[str],
                      extra_names: Sequence[str]) -> None:
    """Refuse a task named twice, naming the option it was given in: twice in --tasks
    (``own``, as TASK[:METRIC]; ``own_names``, their task names), twice in --general
    (``extra``: verify's general tasks), or in --general as one of the run's own."""
    def twice(names: Sequence[str]) -> str | None:
        return next((name for at, name in enumerate(names) if name in names[:at]), None)

    if (name := twice(own_names)) is not None:
        raise UsageError(f"--tasks {','.join(own)}: task {name!r} is named twice")
    if (name := twice(extra_names)) is not None:
        raise UsageError(f"--general {','.join(extra)}: task {name!r} is named twice")
    if (name := next((n for n in extra_names if n in own_names), None)) is not None:
        raise UsageError(f"--general {','.join(extra)}: task {name!r} is one of the run's "
                         f"own tasks (--tasks {','.join(own)}), measured already; name "
                         "another")


#: GenerationConfig fields --gen-kwargs refuses, and why: lm-eval's HF model passes some
#: to ``generate`` itself (given again they clash), reads one plain sequence back (the
#: rest would break that), and two are the config file's bookkeeping.
_HARNESS_GENERATION = {
    **dict.fromkeys(("max_length", "max_new_tokens", "pad_token_id", "use_cache"),
                    "lm-eval's generate_until sets it itself (the length: max_gen_toks)"),
    **dict.fromkeys(("num_return_sequences", "return_dict_in_generate", "output_scores",
                     "output_logits", "output_attentions", "output_hidden_states"),
                    "lm-eval reads back one generated sequence, as plain tokens"),
    **dict.fromkeys(("_from_model_config", "transformers_version"),
                    "a generation config file's record, not a generation argument"),
}


def _fewshot_extra(task: Any) -> int:
    """The documents lm-eval draws beyond the few-shot count: 1 where the task's few-shot
    split is its test split, both unset included (``ConfigurableTask.fewshot_context`` then
    hands the sampler the question, which draws one more to leave it out), else 0 (MMLU's
    5 dev documents give its 5 shots). A task of another class: 1, as lm-eval's older
    ``Task`` may draw."""
    fewshot = getattr(task, "fewshot_cfg", None)
    if fewshot is None or not hasattr(fewshot, "split"):
        return 1
    return int(fewshot.split == task.config.test_split)


class NoEffectError(UsageError):
    """An option that would change nothing for the measured tasks (``cross`` leaves out
    such an option it took from its runs rather than refuse it)."""


def check_task_overrides(spec: RunSpec, loaded: Mapping[str, Any],
                         context: int | None = None, generates: bool = True) -> None:
    """Refuse an --examples-part with no document of a task (it measured them all), and
    --num-fewshot and --gen-kwargs where they would change nothing or fail once
    the model is loaded (more few-shot examples than a task can draw, more new tokens than
    the model's ``context``), and generation arguments no model's ``generate`` takes —
    before any weights load (``loaded``: each task name -> what ``TaskManager.load``
    built)."""
    leaves = {leaf: task for entry in loaded.values() for leaf, task in entry["tasks"].items()}
    part = parse_examples_part(spec.examples_part)
    if part is not None:  # the subset each measurement takes, as it will take it
        counts = {leaf: len(task.eval_docs) for leaf, task in leaves.items()}
        subset = choose_subset(counts, spec.num_samples, spec.seed, part) or {}
        for leaf, picked in sorted(subset.items()):
            if not picked:  # read as "every document": the whole task, and runs on other
                # parts called disjoint
                raise UsageError(f"--examples-part {spec.examples_part}: task {leaf!r} has "
                                 f"{counts[leaf]} documents, so part {part[0]} of {part[1]} "
                                 f"holds none; give at most {counts[leaf]} parts")
    if spec.num_fewshot is not None:
        fixed = sorted(leaf for leaf, task in leaves.items()
                       if task.get_config("num_fewshot") == 0)
        if len(fixed) == len(leaves):
            raise NoEffectError(f"--num-fewshot {spec.num_fewshot}: every task's YAML fixes "
                                f"its few-shot count at 0 ({', '.join(fixed)}), which lm-eval "
                                "keeps; it would change nothing")
        if fixed:
            log.warning("--num-fewshot %d: %s keep 0 few-shot examples (their YAML fixes it; "
                        "lm-eval keeps it)", spec.num_fewshot, ", ".join(fixed))
        for leaf, task in sorted(leaves.items()):
            try:
                pool = len(task.fewshot_docs()) if leaf not in fixed else None
            except TypeError:  # a pool without a length: lm-eval's to judge
                pool = None
            extra = _fewshot_extra(task)
            if pool is not None and spec.num_fewshot + extra > pool:
                why = ", and lm-eval draws one more than it uses here" if extra else ""
                raise UsageError(f"--num-fewshot {spec.num_fewshot}: task {leaf!r} has "
                                 f"{pool} documents to draw few-shot examples from{why}; "
                                 f"at most {pool - extra}")
    gen_kwargs = parse_gen_kwargs(spec.gen_kwargs)
    tokens = (gen_kwargs or {}).get("max_gen_toks")
    if tokens is not None and context is not None and tokens >= context:
        raise UsageError(f"--gen-kwargs max_gen_toks={tokens}: the model takes {context} "
                         "tokens, prompt and generation together; give fewer")
    if generates and spec.signal == "metric" and context is not None:
        _check_generation_fits(leaves, gen_kwargs or {}, context)
    if gen_kwargs is None:
        return
    kinds = sorted({str(task.get_config("output_type")) for task in leaves.values()})
    if "generate_until" not in kinds:
        raise NoEffectError(f"--gen-kwargs: none of the tasks generates text (their output "
                            f"types: {', '.join(kinds)}); it would change nothing")
    if spec.signal == "logprob":
        raise NoEffectError("--gen-kwargs: --signal logprob scores the generation tasks on "
                            "their reference answers, teacher-forced, without generating; it "
                            "would change nothing")
    from transformers import GenerationConfig

    known = (set(GenerationConfig().to_dict()) | {"until", "max_gen_toks"}) \
        - set(_HARNESS_GENERATION)
    for key in sorted(gen_kwargs):
        if key in _HARNESS_GENERATION:
            raise UsageError(f"--gen-kwargs {key}=...: {_HARNESS_GENERATION[key]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise UsageError(f"--gen-kwargs {key}=...: not a generation argument (lm-eval's "
                             "until and max_gen_toks, or a field of transformers' "
                             f"GenerationConfig such as temperature, top_p, do_sample){hint}")
    if {"do_sample", "temperature"} & set(gen_kwargs):
        _check_sampling_temperature(gen_kwargs, leaves)


#: The new tokens lm-eval's HF model generates where a task's generation arguments name
#: none (``HFLM.max_gen_toks``, a fixed property).
LM_EVAL_MAX_GEN_TOKS = 256


def _new_tokens(gen_kwargs: Mapping[str, Any], default: int) -> int:
    """The new tokens ``gen_kwargs`` ask for, under whichever of its names lm-eval reads
    (``normalize_gen_kwargs``: max_gen_toks, max_new_tokens, ...), else ``default``."""
    from lm_eval.models.utils import normalize_gen_kwargs

    # Only the lengths: the sampling arguments are _check_sampling_temperature's to judge.
    lengths = {k: v for k, v in gen_kwargs.items() if k not in ("do_sample", "temperature")}
    return int(normalize_gen_kwargs(lengths, default)["max_gen_toks"])


def _check_generation_fits(leaves: Mapping[str, Any], gen_kwargs: Mapping[str, Any],
                           context: int) -> None:
    # lm-eval's HF model asserts that a generation leaves room for a prompt, at the first
    # generation, after the load: a task's own max_gen_toks (or lm-eval's 256) on a model
    # of a shorter context (GPT-2's 1024 and a task asking 1024) is said here instead.
    for leaf, task in sorted(leaves.items()):
        if task.get_config("output_type") != "generate_until":
            continue
        own = task.get_config("generation_kwargs") or {}
        try:
            tokens = _new_tokens({**own, **gen_kwargs}, LM_EVAL_MAX_GEN_TOKS)
            source = ("--gen-kwargs'" if _new_tokens(gen_kwargs, 0) else
                      "its YAML's" if _new_tokens(own, 0) else "lm-eval's default")
        except (TypeError, ValueError):  # the task's own value: lm-eval's to judge
            continue
        if tokens >= context:
            raise UsageError(f"task {leaf!r} generates up to {tokens} tokens ({source} "
                             f"length), and the model takes {context} tokens, prompt and "
                             "generation together; give fewer with --gen-kwargs "
                             f"max_gen_toks=N (N below {context})")


def _check_sampling_temperature(gen_kwargs: Mapping[str, Any],
                                leaves: Mapping[str, Any]) -> None:
    # lm-eval samples at temperature 0.0 where a task sets none, and generate refuses to
    # sample at 0 (a ValueError at the first measurement): say it before the load.
    for leaf, task in sorted(leaves.items()):
        if task.get_config("output_type") != "generate_until":
            continue
        own = task.get_config("generation_kwargs") or {}
        effective = {**own, **gen_kwargs}
        try:
            cold = float(effective.get("temperature", 0.0)) == 0.0
        except (TypeError, ValueError):  # the task's own value: lm-eval's to judge
            continue
        if effective.get("do_sample") is True and cold:
            source = ("--gen-kwargs" if "temperature" in gen_kwargs else
                      "its YAML's" if "temperature" in own else "lm-eval's default")
            raise UsageError(f"--gen-kwargs: task {leaf!r} would sample (do_sample=true) at "
                             f"temperature 0 ({source}), which generate refuses; give a "
                             "temperature above 0 (e.g. temperature=1.0), or leave do_sample "
                             "false for greedy decoding")


def _column_count(spec: RunSpec, geometry: Geometry) -> int:
    """The components a run ranks: every head, and with neurons ``--candidates`` of them
    (auto: as many as the heads), refused when the model has fewer MLP neurons."""
    heads = geometry.total_heads
    if spec.components == "heads":
        return heads
    count = _candidate_count(spec, geometry)
    check_candidates(count, geometry.total_neurons)
    width = geometry.neurons_per_layer
    if width is not None and spec.neuron_groups > width:
        raise UsageError(f"--neuron-groups {spec.neuron_groups}: a layer's MLP has only "
                         f"{width} neurons to group")
    # Groups: at most G per layer (fewer only where the candidates fill a layer).
    groups = spec.neuron_groups * geometry.num_layers
    return count + groups + (heads if "heads" in spec.components.split("+") else 0)


def check_candidates(count: int, total_neurons: int | None, never: int = 0) -> None:
    """Refuse ``--candidates count`` beyond the model's ``total_neurons`` MLP neurons (None:
    unknown, nothing to check) less the ``never`` that --never-ablate keeps out."""
    if total_neurons is None:
        return
    if count > total_neurons:
        raise UsageError(f"--candidates {count}: the model has only {total_neurons} MLP "
                         "neurons")
    if count > total_neurons - never:
        raise UsageError(f"--candidates {count}: --never-ablate keeps {never} of the model's "
                         f"{total_neurons} MLP neurons out, leaving {total_neurons - never}")


def _candidate_count(spec: RunSpec, geometry: Geometry) -> int:
    """--candidates as a number (auto: as many as the model has heads)."""
    return geometry.total_heads if spec.candidates == "auto" else int(spec.candidates)


def check_design_budget(masks: int, total_heads: int, flag: str = "--masks") -> None:
    """Refuse a design matrix too large to hold in memory and save (one byte per entry)."""
    if masks * total_heads > MAX_DESIGN_BYTES:
        raise UsageError(f"{flag} {masks}: the design ({masks} masks x {total_heads} heads) "
                         f"would take {masks * total_heads / 2**30:.1f} GiB; at most "
                         f"{MAX_DESIGN_BYTES // total_heads} masks fit the "
                         f"{MAX_DESIGN_BYTES // 2**20} MiB limit for this model")


# --- the model and the measurement loop -----------------------------------------------


