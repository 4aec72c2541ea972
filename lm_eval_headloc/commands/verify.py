"""``verify``: the paper's verification table. Knock out a run's top 1..k components
(heads, MLP neurons or both) cumulatively and measure the run's task(s) ("Task" drop) and
general tasks (mean "Gen" drop); with CNL's checks beside it: the top-k against random
sets of as many components of each kind, and, when ``--scale`` is not 0 (2: enhance), the
same sets erased (scale 0).

The pieces cross shares (``located_heads``, ``ablations``, ``effect``) are here too."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lm_eval_headloc.commands.overlap import RankingFile
from lm_eval_headloc.common import timing
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.words import counted
from lm_eval_headloc.intervention.arg_string import ModelArgs
from lm_eval_headloc.intervention.components import (
    Head,
    Neuron,
    component_key,
    names_neurons,
    parse_components,
    read_heads_file,
    shown_name,
)
from lm_eval_headloc.intervention.embedded import is_embedded, local_pretrained
from lm_eval_headloc.intervention.geometry import Geometry
from lm_eval_headloc.intervention.model_args import same_model
from lm_eval_headloc.measurement.store import PlanEntry
from lm_eval_headloc.method.ranking import relative_drop
from lm_eval_headloc.runs.folder import (
    RunFolder,
    checked_path,
    refuse_output_path_into,
    refuse_recorded_code,
)
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.plan import measured_plan
from lm_eval_headloc.runs.record import (
    RunRecord,
    check_model_files,
    load_run,
    ranking_files,
    read_ranking_file,
)
from lm_eval_headloc.runs.setup import prepare
from lm_eval_headloc.runs.spec import ABLATION_FLAGS, COMMAND_OPTIONS, RunSpec, command_spec

__all__ = ["DEFAULT_GENERAL", "OFFLINE_GENERAL", "Ablation", "ablations", "effect",
           "kind_words", "located_heads", "percent", "random_like", "random_sets",
           "verification_markdown", "verify"]

DEFAULT_GENERAL = ("hellaswag", "boolq", "arc_challenge", "mmlu")  # the paper's
# The embedded model runs where nothing can be downloaded: offline general tasks.
OFFLINE_GENERAL = ("headloc_induction", "headloc_ioi", "headloc_arith")


# --- what verify and cross share ----------------------------------------------------------

def located_heads(folder: RunFolder, task: str, top_k: int,
                  record: RunRecord | None = None) -> list[str]:
    """The first ``top_k`` components (heads, MLP neurons) of ``task``'s ranking in the run
    ``folder`` (``heads-<task>.json``; ``record``: the run's, where loaded already); a
    one-line error when there is none or it ranks fewer."""
    path = folder.ranking_file(task)
    # A locate or greedy run's (a sweep's folder said as a sweep, not as unfinished; a
    # config.json naming another command refused), checked as every reader checks it.
    if path not in ranking_files(folder, record):
        raise RunFolderError(f"{folder.path} has no {path.name}; finish the run first")
    read_ranking_file(path)
    ranked = read_heads_file(path)
    if len(ranked) < top_k:
        ranks = counted(len(ranked), kind_words(ranked, plural=False), kind_words(ranked))
        raise UsageError(f"--top-k {top_k}: {path.name} ranks only {ranks}")
    return ranked[:top_k]


def ranking_notes(folder: RunFolder, task: str, top_k: int) -> list[str]:
    """What the run's own ranking of ``task`` says of its top-k that the bare list of
    names drops (``overlap.RankingFile``): that it found nothing, a tie across the k-th
    place, places filled by components that do not hurt, harms within the spread of
    single knockouts. [] where it says none of these."""
    ranking = RankingFile.read(folder.ranking_file(task))
    nothing = ranking.nothing_found(top_k)
    if nothing:
        return [f"the run found nothing: {nothing}"]
    notes = []
    _, group, places = ranking.cut(top_k)
    if group:
        notes.append(f"{', '.join(map(shown_name, group))} have the same evidence across the "
                     f"top-{top_k}'s last place: it holds {places} of them by index, not by "
                     "evidence")
    notes += _harmless_notes(ranking, top_k, read_ranking_file(
        folder.ranking_file(task)).get("method"))
    within = ranking.within_spread(top_k)
    if within:
        notes.append(f"{', '.join(map(shown_name, within))}: hurt the task by no more than a "
                     "single knockout helps it (within the spread of single knockouts)")
    return notes


def _harmless_notes(ranking: RankingFile, top_k: int, method: object = None) -> list[str]:
    """What the top-k's components recorded to do no harm are there for: after the last
    that hurts, places filled because fewer hurt; before one that hurts (iterative greedy
    ranks heads in the order they won its rounds, not by harm), their place in the order.
    ``method``: the ranking file's."""
    after, above = ranking.harmless_places(top_k)
    why = (" (iterative greedy ranks heads in the order they won its rounds, each measured "
           "with the earlier winners knocked out)" if method == "iterative greedy" else "")
    notes = []
    for name, below in above.items():
        notes.append(f"{shown_name(name)}: recorded to do no harm, yet ranked above "
                     f"{', '.join(map(shown_name, below))}, which hurt"
                     f"{'s' if len(below) == 1 else ''} the task{why}: listed for its place "
                     "in that order, not because fewer hurt")
    if after:
        notes.append(f"{', '.join(map(shown_name, after))}: recorded to do no harm, "
                     "listed because fewer hurt")
    return notes


def kind_words(names: Iterable[str], plural: bool = True) -> str:
    """What a set of component names is, in the tables' words: ``heads``, ``MLP neurons``
    or, mixed, ``components`` (so a table of heads reads as it always has); with
    ``plural=False`` what one of them is (``head``, ...). A neuron group's entry
    (its neurons '+'-joined) is one component, not neurons: "the top-8 MLP neurons" of a
    ranking with a group of 2 among them knocked out 9 neurons."""
    kinds: set[object] = set()
    for name in names:
        parsed = parse_components([name])
        kinds.add("group" if len(parsed) > 1 else isinstance(parsed[0], Neuron))
    word = ("component" if len(kinds) > 1 else "MLP neuron" if True in kinds
            else "neuron group" if "group" in kinds else "head")
    return word + "s" if plural else word


class Ablation(NamedTuple):
    """One way a set is knocked out: its measurement keys end in ``suffix``; ``entry``
    is the plan entry's scale (None: the model's own, the run's --scale)."""

    suffix: str
    entry: float | None
    scale: float
    name: str


def scale_name(scale: float) -> str:
    """erase (0), enhance (above 1) or the number: how CNL names what a scale does."""
    return "erase" if scale == 0 else "enhance" if scale > 1 else f"scale {scale:g}"


def ablation_words(kind: str | None) -> list[str]:
    """What ×0 and ×S mean under ``kind`` (the run's --ablation) when it is not zero:
    CNL's erase and enhance (zeroed, doubled) are zero ablation's."""
    if kind in (None, "zero"):
        return []
    reference = {"mean": "its mean over the reference examples",
                 "resample": "its output on a donor example"}.get(kind, f"its {kind} value")
    return [f"Knocked out by {kind} ablation: at scale S a component's output z becomes "
            f"r + S·(z − r), r {reference}; ×0 puts r in its place and ×2 doubles its "
            "difference from r (not the output itself, as under zero ablation).", ""]


def ablations(scale: float) -> list[Ablation]:
    """The ablations a set is measured under: erase (scale 0) first, and the run's
    --scale beside it when that is not 0 (CNL's enhance next to erase). The run's scale
    is the model's own, so only an erase beside it needs a scale of its own."""
    own = Ablation("", None, float(scale), scale_name(scale))
    return [own] if scale == 0 else [Ablation("-erase", 0.0, 0.0, "erase"), own]


def effect(base: Mapping[str, Any], record: Mapping[str, Any], task: str,
           general: Sequence[str] = ()) -> dict[str, Any]:
    """What knocking a set out did: ``task``'s score and its drop relative to the
    baseline (positive = worse; NaN at a zero baseline), and the ``general`` tasks'
    scores, drops and mean drop (None when none is defined)."""
    drops = {g: relative_drop(base["scores"][g], record["scores"][g],
                              base["higher_is_better"][g]) for g in general}
    defined = [d for d in drops.values() if math.isfinite(d)]
    return {"score": record["scores"][task],
            "task_drop": relative_drop(base["scores"][task], record["scores"][task],
                                       base["higher_is_better"][task]),
            "gen_drop": float(np.mean(defined)) if defined else None,
            "general_scores": {g: record["scores"][g] for g in general},
            "general_drops": drops}


def percent(value: float | None) -> str:
    """A drop as a percentage ("n/a": undefined); never "-0.0 %"."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{round(100 * value, 1) + 0.0:.1f} %"


# --- the random baseline --------------------------------------------------------------------

# The kinds a random set is drawn of, in the order drawn: heads first, so a set of heads
# takes the generator's draws it always took. (kind, what it is called, its count per
# layer in a Geometry)
_KINDS: tuple[tuple[type[Head] | type[Neuron], str, str], ...] = (
    (Head, "heads", "heads_per_layer"), (Neuron, "MLP neurons", "neurons_per_layer"))
#: What one and several of each kind are called (``counted``'s nouns).
_KIND_WORDS: dict[type, tuple[str, str]] = {Head: ("head", "heads"),
                                             Neuron: ("MLP neuron", "MLP neurons")}


def _pools(located: Sequence[str], geometry: Geometry, avoid: Iterable[str] = ()
           ) -> list[tuple[type[Head] | type[Neuron], int, np.ndarray, int]]:
    """Per kind ``located`` has, heads first: ``(kind, its count per layer, the pool of
    flat indices a random set draws from, how many it draws)``. Raises ``ValueError`` as
    ``random_like`` says."""
    components = parse_components(list(located))
    barred_all = [*components, *parse_components(list(avoid))]
    pools = []
    for kind, what, count_field in _KINDS:
        wanted = sum(isinstance(c, kind) for c in components)
        if not wanted:
            continue
        per_layer = getattr(geometry, count_field)
        if per_layer is None:
            raise ValueError(f"the model's config does not give its MLP width, so no random "
                             f"{what} can be drawn before the weights load")
        # A hybrid model's layers without heads have none to draw.
        layers = geometry.layers_with_heads if kind is Head else range(geometry.num_layers)
        every = np.asarray([layer * per_layer + i for layer in layers
                            for i in range(per_layer)], dtype=np.int64)
        barred = {c.layer * per_layer + c[1] for c in barred_all if isinstance(c, kind)}
        pool = np.setdiff1d(every, sorted(barred))
        if len(pool) < wanted:
            raise ValueError(f"{len(barred)} {what} located or kept out leave {len(pool)} of "
                             f"the model's {len(every)}, fewer than a random set of {wanted}")
        pools.append((kind, per_layer, pool, wanted))
    return pools


def random_like(located: Sequence[str], geometry: Geometry, rng: np.random.Generator,
                avoid: Iterable[str] = ()) -> list[str]:
    """As many components of each kind as ``located`` has (heads, MLP neurons), drawn
    uniformly without replacement from the model's (``geometry``, read from its config:
    no weights needed), none of them in ``located`` or ``avoid``; their names, sorted.

    The random baseline asks whether the located set matters more than any other set of
    its size and make-up, so it never shares a component with it. Each kind is drawn from
    its own pool, heads first (a set of heads draws what it drew before neurons existed).
    Raises ``ValueError`` when too few components of a kind are left to draw from, or
    neurons are wanted and the MLP's width is unknown (None in ``geometry``).
    """
    drawn: list[Head | Neuron] = []
    for kind, per_layer, pool, wanted in _pools(located, geometry, avoid):
        picked = rng.choice(pool, size=wanted, replace=False)
        drawn += [kind(*divmod(int(i), per_layer)) for i in picked]
    return [str(c) for c in sorted(drawn, key=component_key)]


def random_sets(located: Sequence[str], geometry: Geometry, draws: int, seed: int,
                task: str, avoid: Iterable[str] = ()) -> list[list[str]]:
    """``draws`` distinct sets ``random_like(located)`` (a set drawn again is drawn
    anew: repeats counted twice in the spread), drawn in turn from one generator seeded
    by (``seed``, ``task``) — ``np.random.default_rng([seed, zlib.crc32(task)])``, as the
    example subsets are — so another task's draws do not change these, and more draws
    keep the first ones. More draws than there are distinct sets (per kind, the ways to
    choose as many as ``located`` has from the pool ``random_like`` draws from,
    multiplied) are refused before any is drawn: the draws repeat sets from there on, and
    a billion draws was a run that never ended."""
    rng = np.random.default_rng([seed, zlib.crc32(task.encode())])
    avoid = list(avoid)
    try:
        pools = _pools(located, geometry, avoid) if draws else []
        distinct = math.prod(math.comb(len(pool), wanted) for _, _, pool, wanted in pools)
        sets: list[list[str]] = []
        while len(sets) < draws <= distinct:  # distinct sets: a repeat is drawn again
            drawn = random_like(located, geometry, rng, avoid)
            if drawn not in sets:
                sets.append(drawn)
    except ValueError as err:
        raise UsageError(f"--random-draws {draws}: {err} (0 turns the baseline off)") \
            from None
    if draws > distinct:
        made_of = " and ".join(f"{counted(wanted, *_KIND_WORDS[kind])} of the {len(pool):,}"
                               for kind, _, pool, wanted in pools)
        raise UsageError(f"--random-draws {draws}: only {distinct:,} distinct random sets can "
                         f"be drawn ({made_of} outside the located set, --exclude and "
                         f"--never-ablate); give at most {distinct} (0 turns the baseline "
                         "off)")
    return sets


def _pretrained(model_args: str) -> str:
    """The model resolved ``model_args`` load, as the user named it: ``pretrained=…``."""
    return f"pretrained={ModelArgs.parse(model_args).args['pretrained']}"


def _refuse_moved_model(model_args: str | None, fingerprint: str | None) -> None:
    """A run's model loaded from a folder that is not there (moved, the run folder came
    from another machine, or a relative ``pretrained=`` read from another working
    directory): say how to name its new place, before anything loads. ``fingerprint``:
    the run's recorded ``model_fingerprint``, which says its model was a local folder
    (else a relative name is a Hub id)."""
    pretrained = ModelArgs.parse(model_args).get("pretrained")
    if not isinstance(pretrained, str):
        return
    path = Path(str(local_pretrained(pretrained)))
    if (path.is_absolute() or fingerprint is not None) and not path.exists():
        here = "" if path.is_absolute() else f" (from {Path.cwd()})"
        raise UsageError(f"the run's model pretrained={pretrained} is not there{here}; if "
                         "it has moved, give its new place with --model-args "
                         "pretrained=<folder>,... (the run's other model args as they were)")


def _check_moved_model(stored: Any, fingerprint: str | None, given: str | None) -> None:
    """``--model-args`` naming another model than the run's: accepted where it is the
    run's model moved elsewhere (its files' fingerprint is the one the run recorded)."""
    if stored.model_fingerprint is None:
        raise UsageError(f"--model-args {given}: not the run's model "
                         f"({stored.spec.model_args}), and the run recorded no fingerprint "
                         "of its model's files to check a new place against (runs made "
                         "before they did); leave --model-args out")
    if fingerprint != stored.model_fingerprint:
        raise UsageError(f"--model-args {given}: not the run's model: its files differ from "
                         "the ones the run was made with")


def _spread(values: Iterable[float | None]) -> dict[str, float | None]:
    """Mean, sample standard deviation, min and max of the defined values."""
    defined = [v for v in values if v is not None and math.isfinite(v)]
    if not defined:
        return {"mean": None, "sd": None, "min": None, "max": None}
    return {"mean": float(np.mean(defined)),
            "sd": float(np.std(defined, ddof=1)) if len(defined) > 1 else None,
            "min": float(min(defined)), "max": float(max(defined))}


def _beaten(baseline: float, located: float, drawn: Iterable[float]) -> int | None:
    """Random sets that moved the task's score (``drawn``, from ``baseline``) less in
    absolute change than the located set's score (``located``): erased or enhanced, what
    matters is how much a set moves it. By the scores, not the relative drops: the same
    count where the baseline is not 0, and defined where it is (a drop relative to 0 is
    not)."""
    if not math.isfinite(located) or not math.isfinite(baseline):
        return None
    moved = abs(located - baseline)
    return sum(1 for d in drawn if math.isfinite(d) and abs(d - baseline) < moved)


# --- verify ------------------------------------------------------------------------------

@timing.on_clock
def verify(run: str | Path, out: str | Path | None = None, spec: RunSpec | None = None, *,
           force: bool = False, **options: Any) -> dict[str, Any]:
    """Verify run ``run``; the table goes to ``out`` (default ``RUN/verify``).

    The model, tasks and chat-template setting are the run's; ``spec`` or keyword options
    give verify's own (top_k, general, limit, random_draws, batch_size, …). ``ablation``,
    ``scale`` and ``ablation_data`` keywords change the run's ablation for the
    verification; ``model_args`` names the run's model where it is now (a model folder
    that moved: its files must be the ones the run recorded); ``gen_kwargs`` replaces the
    run's generation arguments (verify generates where a logprob run did not).
    """
    # The ablation is the run's unless given (verify --ablation mean checks heads found
    # under one kind under another); zero ablation takes no reference set.
    kind = {name: options.pop(name) for name in ABLATION_FLAGS if options.get(name) is not None}
    if kind.get("ablation") == "zero":
        kind.setdefault("ablation_data", None)
    if "ablation_data" in kind:  # the run's JSONL field belongs to the run's file
        kind.setdefault("ablation_field", None)
    own = command_spec("verify", spec, options, (*ABLATION_FLAGS, "model_args", "gen_kwargs"))
    source = RunFolder(run)
    stored = load_run(source)
    out = (checked_path(out, "--out", "runs/x-verify") if out is not None
           else source.path / "verify")
    RunFolder(out).refuse_inside([run])  # before anything slow: a plain mistake
    # Verification reports the tasks' own metrics, whatever signal the run ranked by, on
    # whole tasks or --limit's first documents: never the run's --examples-part (which
    # would cut the general tasks too, and --limit would silently drop).
    spec = stored.spec.replace(
        signal="metric", examples_part=None,
        **{name: getattr(own, name) for name in (*COMMAND_OPTIONS["verify"], "progress")},
        **kind)
    if own.model_args is not None:  # the run's model where it is now
        spec = spec.replace(model_args=own.model_args)
    if own.gen_kwargs is not None:  # else the run's: measured as it was located
        spec = spec.replace(gen_kwargs=own.gen_kwargs)
    refuse_recorded_code(run, stored.spec.include_path,
                         None if own.model_args is not None else stored.spec.model_args,
                         "give --model-args with trust_remote_code=True to run it")
    spec.validate()
    refuse_output_path_into(spec.output_path, [run], out)
    heads_by_task = {name: located_heads(source, name, spec.top_k, stored)
                     for name in (t.split(":")[0] for t in spec.tasks)}
    general = spec.general if spec.general is not None else (
        OFFLINE_GENERAL if is_embedded(spec.model_args) else DEFAULT_GENERAL)
    general = tuple(g for g in general if g not in heads_by_task)
    if spec.general is not None and not general:
        which = "task" if len(spec.general) == 1 else "tasks"
        raise UsageError(f"--general {','.join(spec.general)}: the run's own {which}, "
                         "measured in the Task column; name another task (or leave --general "
                         "out)")
    spec = spec.replace(general=general)
    if own.model_args is None:
        _refuse_moved_model(spec.model_args, stored.model_fingerprint)
    setup = prepare(spec, extra_tasks=general)
    if not same_model(setup.spec.model_args, stored.spec.model_args):
        _check_moved_model(stored, setup.model_fingerprint, own.model_args)
    else:
        check_model_files(stored.model_fingerprint, setup.model_fingerprint, run,
                          "if it moved, give its new place with --model-args",
                          model_args=setup.spec.model_args)
    for names in heads_by_task.values():
        setup.checked(names)  # a ranking of another model fails before the weights load
    # The model's components from its config (prepare's): the draws need no weights. A
    # config without the MLP's width (BLOOM's) has it in the run's record, from its weights.
    geometry = setup.geometry
    if geometry.neurons_per_layer is None and getattr(stored, "neurons_per_layer", None):
        geometry = dataclasses.replace(geometry, neurons_per_layer=stored.neurons_per_layer)
    if spec.random_draws and geometry.neurons_per_layer is None and any(
            names_neurons(names) for names in heads_by_task.values()):
        raise UsageError(f"--random-draws {spec.random_draws}: the config of "
                         f"{_pretrained(setup.spec.model_args)} does not give its MLP width, so no "
                         "random MLP neurons can be drawn before the weights load (0 turns "
                         "the baseline off)")
    kept_out = [str(h) for h in (*setup.exclude, *setup.never_ablate)]
    drawn = {task: random_sets(names, geometry, spec.random_draws, spec.seed, task, kept_out)
             for task, names in heads_by_task.items()}
    if spec.ablation != "zero":
        # The run's own tasks on the run's example subset (verify's --limit is another).
        setup.reference = setup.reference_texts(stored.example_subset)
    plan: list[PlanEntry] = [("baseline", [])]
    for ablation in ablations(spec.scale):
        for task, names in heads_by_task.items():
            plan += [(f"{task}-top{k}{ablation.suffix}", parse_components(names[:k]),
                      ablation.entry) for k in range(1, spec.top_k + 1)]
            plan += [(f"{task}-random{i}{ablation.suffix}", parse_components(other),
                      ablation.entry) for i, other in enumerate(drawn[task], start=1)]
    identity = {**spec.identity("verify"), "run": str(Path(run).resolve()),
                "heads": {t: "+".join(h) for t, h in heads_by_task.items()}}
    inherited = spec.ablation != "zero" and not {"ablation", "ablation_data"} & set(kind)
    digest = (stored.ablation or {}).get("reference_digest") if inherited else None
    with measured_plan(out, "verify", spec, setup, plan, identity=identity, protect=[run],
                       force=force, limit=spec.limit,
                       reference_of=None if digest is None else (run, digest)
                       ) as (folder, records):
        table = _verification_table(records, heads_by_task, list(general), spec, drawn)
        table["located_by"] = stored.spec.signal  # verify scores by the tasks' metrics
        # What the generation tasks generated with, and the run's where verify's differ.
        table["gen_kwargs"] = spec.gen_kwargs
        if spec.gen_kwargs != stored.spec.gen_kwargs:
            table["run_gen_kwargs"] = stored.spec.gen_kwargs
        table["ranking_notes"] = {task: ranking_notes(source, task, spec.top_k)
                                  for task in heads_by_task}
        folder.write_json("verify.json", table)
        folder.write_text("verify.md", verification_markdown(table))
    return table


def _verification_table(records: Mapping[str, Mapping[str, Any]],
                        ranked: Mapping[str, list[str]], general: list[str], spec: RunSpec,
                        drawn: Mapping[str, list[list[str]]]) -> dict[str, Any]:
    """verify.json: ``rows`` at the run's --scale (with ``erase`` beside each row when
    that is not 0), and ``random``: the top-k against the random sets (``verify`` adds
    ``located_by`` and ``ranking_notes``)."""
    base = records["baseline"]
    kinds = ablations(spec.scale)
    rows = {}
    for task, names in ranked.items():
        rows[task] = [{"k": k, "heads": names[:k],
                       **effect(base, records[f"{task}-top{k}"], task, general),
                       **({"erase": effect(base, records[f"{task}-top{k}-erase"], task, general)}
                          if len(kinds) > 1 else {})}
                      for k in range(1, spec.top_k + 1)]
    table: dict[str, Any] = {"baseline": base["scores"], "metrics": base["metrics"],
                             "general": general, "scale": spec.scale,
                             "ablation": spec.ablation, "rows": rows,
                             "random_draws": spec.random_draws}
    if spec.random_draws:
        table["random"] = {task: {
            "k": spec.top_k, "seed": spec.seed, "sets": drawn[task],
            "ablations": [_against_random(records, base, task, general, spec, ablation)
                          for ablation in kinds]} for task in ranked}
    return table


def _against_random(records: Mapping[str, Mapping[str, Any]], base: Mapping[str, Any],
                    task: str, general: list[str], spec: RunSpec, ablation: Ablation
                    ) -> dict[str, Any]:
    located = effect(base, records[f"{task}-top{spec.top_k}{ablation.suffix}"], task, general)
    draws = [effect(base, records[f"{task}-random{i}{ablation.suffix}"], task, general)
             for i in range(1, spec.random_draws + 1)]
    return {"name": ablation.name, "scale": ablation.scale,
            "located": {key: located[key] for key in ("score", "task_drop", "gen_drop")},
            "draws": [{key: d[key] for key in ("score", "task_drop", "gen_drop")}
                      for d in draws],
            "task_drop": _spread(d["task_drop"] for d in draws),
            "gen_drop": _spread(d["gen_drop"] for d in draws),
            "beaten": _beaten(base["scores"][task], located["score"],
                              [d["score"] for d in draws])}


def verification_markdown(table: Mapping[str, Any]) -> str:
    """verify.md: per task the cumulative table (at --scale, erase beside it when that is
    not 0), then the located sets against the random ones."""
    general = table["general"]
    kinds = ablations(table.get("scale", 0.0))
    word = kind_words(name for rows in table["rows"].values() for name in rows[-1]["heads"])
    lines = [f"# Verification: cumulative knockout of the top {word}", "",
             *ablation_words(table.get("ablation"))]
    for task, rows in table["rows"].items():
        lines += [f"## {task} ({table['metrics'][task]}), baseline "
                  f"{table['baseline'][task]:.4f}", ""]
        column = kind_words(rows[-1]["heads"])
        # k = 0, nothing knocked out: the scores each column's drop is from (the general
        # tasks' baselines were in verify.json only).
        base = table["baseline"][task]
        if len(kinds) == 1:
            lines += [f"| k | {column} | score | Task drop | Gen drop |"
                      + "".join(f" {g} |" for g in general),
                      "| --- | --- | --- | --- | --- |" + " --- |" * len(general),
                      f"| 0 | none (baseline) | {base:.4f} | – | – |"
                      + "".join(f" {table['baseline'][g]:.4f} |" for g in general)]
            for row in rows:
                lines.append(f"| {row['k']} | {'+'.join(map(shown_name, row['heads']))} | "
                             f"{row['score']:.4f} | "
                             f"{percent(row['task_drop'])} | {percent(row['gen_drop'])} |"
                             + "".join(f" {row['general_scores'][g]:.4f} |" for g in general))
        else:  # erase and the run's scale side by side
            named = [f"{a.name} (×{a.scale:g})" for a in kinds]
            lines += [f"| k | {column} |" + "".join(f" {n} score | Task drop | Gen drop |"
                                                for n in named),
                      "| --- | --- |" + " --- | --- | --- |" * len(kinds),
                      "| 0 | none (baseline) |" + f" {base:.4f} | – | – |" * len(kinds)]
            for row in rows:
                cells = "".join(f" {e['score']:.4f} | {percent(e['task_drop'])} | "
                                f"{percent(e['gen_drop'])} |" for e in (row["erase"], row))
                lines.append(f"| {row['k']} | {'+'.join(map(shown_name, row['heads']))} |{cells}")
        lines.append("")
        notes = table.get("ranking_notes", {}).get(task)
        if notes:
            lines += ["What the run's ranking says of these (its report.md):",
                      *(f"- {note}" for note in notes), ""]
    if table.get("located_by") == "logprob":
        lines += ["The run located these by the gold answers' log-likelihood (--signal "
                  "logprob); verification scores each task by its metric, which can stay "
                  "where the log-likelihood moved.", ""]
    lines += _gen_kwargs_words(table)
    # A general task at a zero baseline has no drop: Gen is the mean over the others.
    undefined = [g for g in general if not table["baseline"][g]]
    lines.append("Drops are relative to the baseline (k = 0; positive = worse; n/a where the "
                 "baseline is 0); Gen is the mean over the general tasks: "
                 + (", ".join(general) or "none")
                 + (f" (less {', '.join(undefined)}, whose baseline is 0)" if undefined
                    else "")
                 + ("" if len(kinds) == 1 else " (each general task's scores: verify.json)")
                 + ".")
    random = table.get("random")
    if random:
        first = next(iter(random.values()))
        # A set is as large as what the top-k knocks out (a neuron group: its neurons).
        sizes = sorted({len(drawn) for entry in random.values() for drawn in entry["sets"]})
        size = (f"{sizes[0]:,}" if len(sizes) == 1 else
                "as many as each task's top-k knocks out")
        drawn_word = kind_words(name for entry in random.values() for drawn in entry["sets"]
                                for name in drawn)  # neurons, where the top has groups
        lines += ["", f"## Against random {drawn_word}: "
                      f"{counted(table['random_draws'], 'set')} "
                      f"of {size} per task (seed {first['seed']})", "",
                  "| task | ablation | top-k Task drop | random mean ± sd | random min – max "
                  "| top-k moves it more than | top-k Gen drop | random Gen drop (mean) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for task, entry in random.items():
            for against in entry["ablations"]:
                spread, gen = against["task_drop"], against["gen_drop"]
                sd = "" if spread["sd"] is None else f" ± {percent(spread['sd'])}"
                beaten = "n/a" if against["beaten"] is None else (
                    f"{against['beaten']} of {len(against['draws'])}")
                lines.append(
                    f"| {task} | {against['name']} (×{against['scale']:g}) | "
                    f"{percent(against['located']['task_drop'])} | "
                    f"{percent(spread['mean'])}{sd} | {percent(spread['min'])} – "
                    f"{percent(spread['max'])} | {beaten} | "
                    f"{percent(against['located']['gen_drop'])} | {percent(gen['mean'])} |")
        same = ("as many heads and as many MLP neurons" if word == "components"
                else f"as many {word}")
        lines += ["", f"Each random set has {same} as the task's top-k, "
                      f"drawn from the {word} outside it (and outside --exclude and "
                      "--never-ablate) and knocked out the same way; \"moves it more than\" "
                      "counts the random sets whose absolute change of the task's score is "
                      "smaller than the top-k's."]
    return "\n".join(lines) + "\n"


def _gen_kwargs_words(table: Mapping[str, Any]) -> list[str]:
    """verify.md's line on the generation arguments (--gen-kwargs) where any were given,
    saying where they are not the run's."""
    given = table.get("gen_kwargs")
    if "run_gen_kwargs" not in table:
        return [] if given is None else [
            f"Generation arguments: `{given}` (the run's --gen-kwargs, over each generation "
            "task's own).", ""]
    run = table["run_gen_kwargs"]
    theirs = "it gave none" if run is None else f"it gave `{run}`"
    return [f"Generation arguments: `{given}` (verify's --gen-kwargs, over each generation "
            f"task's own), not the run's ({theirs}).", ""]
