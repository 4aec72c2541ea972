"""The Python API behind ``headloc-harness``: locate, refit, greedy, verify, universal, sweep.

Every function validates its arguments before any model is loaded, writes a run folder
(``runfolder.RunFolder``) and resumes one: measurements already on disk are not redone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .designs import DESIGNS, design_matrix
from .embedded import smollm2_model_args
from .heads import Head, HeadSpecError, format_heads, parse_heads, read_heads_file
from .metrics import TaskScore, metrics_of_task, parse_task_metric
from .recovery import HeadLasso
from .report import HeadRanking, heads_table, plot_heatmap, ranked_heads_json
from .runfolder import RunFolder, RunFolderError
from .tasks import check_task_names, make_task_manager

__all__ = ["DEFAULT_TASK", "Setup", "UsageError", "locate", "prepare", "refit", "run_plan"]

DEFAULT_TASK = "headloc_induction"
DEFAULT_GENERAL = ("hellaswag", "boolq", "arc_challenge", "mmlu")


class UsageError(ValueError):
    """A bad argument (reported by the CLI in one line, exit status 2)."""


# --- argument checks (no model loaded) ------------------------------------------------

def _check_positive_int(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise UsageError(f"{name}={value!r}: must be a whole number >= {minimum}")


def _check_sparsity(value: float) -> None:
    if not isinstance(value, (int, float)) or not 0 < value < 1:
        raise UsageError(f"--sparsity {value!r}: must be strictly between 0 and 1")


def _check_alpha(value: float) -> None:
    if not isinstance(value, (int, float)) or value <= 0:
        raise UsageError(f"--alpha {value!r}: must be a number > 0")


def resolve_model_args(model_args: str | None) -> str:
    """None -> the embedded SmolLM2; a device is chosen when none is given."""
    if not model_args:
        return smollm2_model_args()
    keys = {part.split("=", 1)[0].strip() for part in model_args.split(",") if part.strip()}
    if "pretrained" not in keys:
        raise UsageError(f"--model-args {model_args!r}: needs pretrained=<model name or folder>")
    if "device" not in keys:
        import torch

        model_args += ",device=" + ("cuda" if torch.cuda.is_available() else "cpu")
    return model_args


def model_geometry(model_args: str) -> tuple[int, int]:
    """(layers, query heads per layer) from the model's config alone: no weights loaded."""
    from lm_eval.utils import simple_parse_args_string
    from transformers import AutoConfig

    args = simple_parse_args_string(model_args)
    kwargs = {k: args[k] for k in ("revision", "trust_remote_code", "gguf_file", "subfolder")
              if k in args}
    pretrained = str(args["pretrained"])
    try:
        config = AutoConfig.from_pretrained(pretrained, **kwargs)
    except Exception as err:  # noqa: BLE001 — any loading failure is the user's model path
        raise UsageError(f"cannot read the config of pretrained={pretrained!r}: "
                         f"{str(err).splitlines()[0]}") from None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(config.num_hidden_layers), int(config.num_attention_heads)


def head_list(spec: str | None, num_layers: int, num_heads: int, what: str) -> list[Head]:
    """Heads from ``L0H1+L2H3`` or a head file (JSON / one per line), checked against the
    model."""
    if not spec:
        return []
    try:
        names = read_heads_file(spec) if Path(spec).is_file() else spec
        return parse_heads(names, num_layers, num_heads)
    except HeadSpecError as err:
        raise UsageError(f"{what}: {err}") from None


@dataclass
class Setup:
    """What a subcommand knows before loading the model."""

    model_args: str
    tasks: list[tuple[str, str | None]]
    num_layers: int
    num_heads: int
    task_manager: Any
    loaded: dict[str, Any]  # task name -> lm-eval's TaskManager.load result, built once

    @property
    def total_heads(self) -> int:
        return self.num_layers * self.num_heads


def prepare(model_args: str | None, tasks: Sequence[str], include_path: Sequence[str] = (),
            confirm_run_unsafe_code: bool = False) -> Setup:
    """Check the model (config only, no weights), build the tasks once and check their
    names, metrics and whether they run model-written code — all before any weights load."""
    if not tasks:
        raise UsageError("--tasks is empty; name at least one task (e.g. gsm8k)")
    model_args = resolve_model_args(model_args)
    num_layers, num_heads = model_geometry(model_args)
    try:
        manager = make_task_manager(list(include_path))
        specs = [parse_task_metric(t) for t in _join_metric_filters(tasks, manager.all_tasks)]
        check_task_names(manager, [name for name, _ in specs])
    except ValueError as err:
        raise UsageError(str(err)) from None
    if len({name for name, _ in specs}) != len(specs):
        raise UsageError(f"--tasks {','.join(tasks)}: a task is named twice")
    loaded = {name: manager.load([name]) for name, _ in specs}
    for name, metric in specs:
        leaves = loaded[name]["tasks"].values()
        if metric is not None:
            produced = sorted({key for task in leaves for key in metrics_of_task(task)})
            if metric not in produced:
                raise UsageError(f"task {name!r} produces no metric {metric!r}; it produces: "
                                 f"{', '.join(produced)}")
        if not confirm_run_unsafe_code and any(getattr(t, "UNSAFE_CODE", False) for t in leaves):
            raise UsageError(f"task {name!r} executes model-written code; rerun with "
                             "--confirm-run-unsafe-code if you accept that")
    return Setup(model_args, specs, num_layers, num_heads, manager, loaded)


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


# --- the model and the measurement loop -----------------------------------------------

def load_model(setup: Setup, batch_size: int | str = 32) -> Any:
    from .model import HFHeadAblateLM

    return HFHeadAblateLM.create_from_arg_string(setup.model_args, {"batch_size": batch_size})


def open_measurement(setup: Setup, lm: Any, num_samples: int | None, seed: int,
                     apply_chat_template: bool | None, confirm_run_unsafe_code: bool,
                     limit: int | None = None, verbose: bool = False) -> Any:
    from .measure import HarnessMeasurement

    return HarnessMeasurement(lm, setup.tasks, setup.loaded, num_samples=num_samples,
                              seed=seed, apply_chat_template=apply_chat_template,
                              confirm_run_unsafe_code=confirm_run_unsafe_code, limit=limit,
                              verbose=verbose)


Measure = Callable[[Iterable[Head]], Mapping[str, TaskScore]]


def run_plan(folder: RunFolder, measure: Measure, plan: Sequence[tuple[str, list[Head]]],
             desc: str, progress: bool = True, masks_per_pass: int = 1
             ) -> dict[str, dict[str, Any]]:
    """Measure every (key, heads) not yet on disk; return all records by key.

    Each record is appended (and fsynced) before the next measurement (or, with
    ``masks_per_pass`` K > 1, the next pass of K masks) starts, so an interrupted run
    loses at most the work in flight.
    """
    from tqdm import tqdm

    done = {r["key"]: r for r in folder.measurements()}
    todo = [(key, heads) for key, heads in plan if key not in done]
    step = masks_per_pass if hasattr(measure, "measure_many") else 1
    bar = tqdm(total=len(plan), initial=len(plan) - len(todo), desc=desc, unit="meas",
               disable=not progress, dynamic_ncols=True)
    try:
        for start_index in range(0, len(todo), step):
            chunk = todo[start_index:start_index + step]
            start = time.perf_counter()
            if step > 1:
                all_scores = measure.measure_many([h for _, h in chunk], masks_per_pass=step)
            else:
                all_scores = [measure(chunk[0][1])]
            seconds = (time.perf_counter() - start) / len(chunk)
            for (key, heads), scores in zip(chunk, all_scores, strict=True):
                record = {
                    "key": key, "mask": format_heads(heads), "num_knocked_out": len(heads),
                    "scores": {name: s.value for name, s in scores.items()},
                    "metrics": {name: s.metric for name, s in scores.items()},
                    "higher_is_better": {name: s.higher_is_better for name, s in scores.items()},
                    "seconds": round(seconds, 4),
                }
                folder.append_measurement(record)
                done[key] = record
                bar.update(1)
    finally:
        bar.close()
    return {key: done[key] for key, _ in plan}


def masks_per_pass_for_memory(free_bytes: int, batch_size: int, config: Any,
                              bytes_per_value: int = 2, max_length: int = 512,
                              most: int = 64) -> int:
    """How many masks' batches fit in half of ``free_bytes`` during one forward pass.

    Per mask, ``batch_size`` rows of ``max_length`` tokens: one layer's activations
    (residual, q/k/v/output, MLP), the key/value cache the forward keeps for every
    layer, eager attention weights for one layer, and the logits at a few scored
    positions per row (float32). Deliberately generous: a wrong guess costs an
    out-of-memory error, a low one only some speed.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    ffn = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    layers = int(text.num_hidden_layers)
    tokens = batch_size * max_length
    activations = tokens * (6 * hidden + 3 * ffn) * bytes_per_value
    kv_cache = tokens * layers * 2 * kv_heads * head_dim * bytes_per_value
    attention = batch_size * heads * max_length * max_length * bytes_per_value
    logits = batch_size * 8 * int(text.vocab_size) * 4
    per_mask = activations + kv_cache + attention + logits
    return int(max(1, min(most, free_bytes // 2 // per_mask)))


def auto_masks_per_pass(lm: Any) -> int:
    """Masks per forward pass when none is asked for: 1 on a CPU, where the forward is
    compute-bound and batching masks gains little (BENCH.md); on a GPU as many as half
    of the free memory holds (``masks_per_pass_for_memory``)."""
    import torch

    device = torch.device(lm.device)
    if device.type != "cuda":
        return 1
    free, _ = torch.cuda.mem_get_info(device)
    batch = lm.batch_size if isinstance(lm.batch_size, int) else 32
    return masks_per_pass_for_memory(free, batch, lm.model.config,
                                     torch.finfo(lm.model.dtype).bits // 8,
                                     min(int(lm.max_length), 4096))


def _relative_drop(baseline: float, score: float, higher_is_better: bool) -> float:
    """How much of the baseline a knockout removed (positive = worse)."""
    change = (baseline - score) if higher_is_better else (score - baseline)
    return change / abs(baseline) if baseline else float("nan")


# --- locate -----------------------------------------------------------------------------

def _mask_heads(row: np.ndarray, num_heads: int) -> list[Head]:
    return [Head.from_index(i, num_heads) for i in np.flatnonzero(row)]


def fit_rankings(design: np.ndarray, records: Mapping[str, Mapping[str, Any]],
                 tasks: Sequence[str], num_heads: int, alpha: float,
                 exclude: Iterable[Head] = ()) -> dict[str, HeadRanking]:
    """One Lasso per task over the stored measurements (rows in design order)."""
    baseline = records["baseline"]
    excluded = sorted({h.index(num_heads) for h in exclude})
    rankings = {}
    for task in tasks:
        y = np.array([records[f"mask-{i:04d}"]["scores"][task] for i in range(len(design))])
        higher = bool(baseline["higher_is_better"][task])
        # Fitted with an intercept, as the reference code does: the intercept absorbs the
        # small average cost of a mask's unimportant heads (pinning it to the baseline
        # recovers planted heads worse in simulation, see tests/test_designs_recovery.py).
        estimator = HeadLasso(alpha=alpha).fit(design, y)
        order = [int(i) for i in estimator.ranking(higher_is_better=higher, exclude=excluded)]
        rankings[task] = HeadRanking(
            task=task, metric=baseline["metrics"][task], higher_is_better=higher,
            baseline=float(baseline["scores"][task]), effects=np.asarray(estimator.coef_),
            order=order, num_heads=num_heads,
            extra={"r2": float(estimator.r2_), "alpha": alpha,
                   "measurements": int(len(design)),
                   "excluded": [str(Head.from_index(i, num_heads)) for i in excluded]})
    return rankings


def write_locate_results(folder: RunFolder, rankings: Mapping[str, HeadRanking], top_k: int,
                         config: Mapping[str, Any]) -> None:
    tasks = list(rankings)
    for task, ranking in rankings.items():
        folder.write_json(f"heads-{task}.json", ranked_heads_json(ranking, top_k))
        folder.write_text(f"heads-{task}.csv", heads_table(ranking))
    # heads.json / heads.csv are the first task's, for ablate_file=runs/x/heads.json.
    folder.write_json("heads.json", ranked_heads_json(rankings[tasks[0]], top_k))
    folder.write_text("heads.csv", heads_table(rankings[tasks[0]]))
    identity = config["identity"]
    plot_heatmap(list(rankings.values()), top_k, folder.file("heatmap.png"),
                 title=f"{identity.get('design', '')} design, {identity.get('masks', '')} masks, "
                       f"p={identity.get('sparsity', '')}")
    folder.write_text("report.md", locate_report(rankings, top_k, config))


def locate_report(rankings: Mapping[str, HeadRanking], top_k: int,
                  config: Mapping[str, Any]) -> str:
    identity, settings = config["identity"], config["settings"]
    lines = [
        "# Head localization by compressed sensing", "",
        f"- model: `{identity['model_args']}`",
        f"- design: {identity['design']}, {identity['masks']} masks, sparsity "
        f"{identity['sparsity']}, seed {identity['seed']}",
        f"- examples per task: {identity['num_samples']} (the same subset in every measurement)",
        f"- Lasso alpha: {settings['alpha']}",
        f"- never knocked out: {identity.get('never_ablate') or 'none'}",
        f"- excluded from the ranking: {settings.get('exclude') or 'none'}", "",
    ]
    for task, ranking in rankings.items():
        lines += [
            f"## {task} ({ranking.metric}, {'higher' if ranking.higher_is_better else 'lower'}"
            " is better)", "",
            f"Baseline (nothing knocked out): {ranking.baseline:.4f}. "
            f"Fit R² = {ranking.extra['r2']:.3f} over {ranking.extra['measurements']} "
            "measurements.", "",
            "| rank | head | estimated change on knockout |", "| --- | --- | --- |",
        ]
        for rank, head in enumerate(ranking.top(top_k), start=1):
            effect = ranking.effects[head.index(ranking.num_heads)]
            lines.append(f"| {rank} | {head} | {effect:+.4f} |")
        lines.append("")
    lines.append("Check the heads with `headloc-harness verify` (knocks them out for real).")
    return "\n".join(lines) + "\n"


def locate(
    out: str | Path,
    model_args: str | None = None,
    tasks: Sequence[str] = (DEFAULT_TASK,),
    num_samples: int = 100,
    masks: int = 100,
    sparsity: float = 0.02,
    design: str = "stratified",
    alpha: float = 0.01,
    top_k: int = 5,
    seed: int = 0,
    include_path: Sequence[str] = (),
    exclude: str | None = None,
    never_ablate: str | None = None,
    apply_chat_template: bool | None = None,
    confirm_run_unsafe_code: bool = False,
    batch_size: int | str = 32,
    force: bool = False,
    verbose: bool = False,
    progress: bool = True,
    masks_per_pass: int | None = None,
    setup: Setup | None = None,
    lm: Any = None,
    measure: Measure | None = None,
) -> dict[str, HeadRanking]:
    """Compressed-sensing localization (SPEC §2); returns each task's ranking.

    ``setup``/``lm``/``measure`` let ``sweep`` reuse a loaded model and its measurement.
    """
    if design not in DESIGNS:
        raise UsageError(f"--design {design!r}: must be one of {', '.join(DESIGNS)}")
    _check_positive_int("--masks", masks)
    _check_positive_int("--num-samples", num_samples)
    _check_positive_int("--top-k", top_k)
    _check_positive_int("--seed", seed, minimum=0)
    _check_sparsity(sparsity)
    _check_alpha(alpha)
    if masks_per_pass is not None:
        _check_positive_int("--masks-per-pass", masks_per_pass)
    setup = setup or prepare(model_args, tasks, include_path, confirm_run_unsafe_code)
    if top_k > setup.total_heads:
        raise UsageError(f"--top-k {top_k}: the model has only {setup.total_heads} heads")
    excluded = head_list(exclude, setup.num_layers, setup.num_heads, "--exclude")
    protected = head_list(never_ablate, setup.num_layers, setup.num_heads, "--never-ablate")
    if len(protected) >= setup.total_heads:
        raise UsageError("--never-ablate covers every head; nothing is left to knock out")

    folder = RunFolder(out)
    identity = {
        "model_args": setup.model_args, "tasks": [f"{n}:{m}" if m else n for n, m in setup.tasks],
        "design": design, "masks": masks, "sparsity": sparsity, "seed": seed,
        "num_samples": num_samples, "never_ablate": format_heads(protected),
        "include_path": [str(Path(p).resolve()) for p in include_path],
        "apply_chat_template": apply_chat_template,
    }
    settings = {"alpha": alpha, "top_k": top_k, "exclude": format_heads(excluded)}
    folder.start("locate", identity, settings, force=force)
    matrix = design_matrix(design, masks, setup.total_heads, sparsity, seed,
                           never_ablate=[h.index(setup.num_heads) for h in protected])
    np.save(folder.file("design_matrix.npy"), matrix)

    if measure is None:
        lm = lm if lm is not None else load_model(setup, batch_size)
        measure = open_measurement(setup, lm, num_samples, seed, apply_chat_template,
                                   confirm_run_unsafe_code, verbose=verbose)
    subset = getattr(measure, "subset", None)
    folder.update_config(example_subset=subset,
                         layers=setup.num_layers, heads_per_layer=setup.num_heads)
    plan = [("baseline", [])] + [(f"mask-{i:04d}", _mask_heads(row, setup.num_heads))
                                 for i, row in enumerate(matrix)]
    if masks_per_pass is None:
        masks_per_pass = auto_masks_per_pass(measure.lm) if hasattr(measure, "lm") else 1
    records = run_plan(folder, measure, plan, desc="locate", progress=progress,
                       masks_per_pass=masks_per_pass)
    rankings = fit_rankings(matrix, records, [n for n, _ in setup.tasks], setup.num_heads,
                            alpha, excluded)
    write_locate_results(folder, rankings, top_k, folder.read_config())
    return rankings


def refit(out: str | Path, alpha: float | None = None, top_k: int | None = None,
          exclude: str | None = None) -> dict[str, HeadRanking]:
    """Fit again from the stored measurements, without touching the model."""
    folder = RunFolder(out)
    config = folder.read_config()
    if config.get("command") != "locate":
        raise RunFolderError(f"{out} holds a '{config.get('command')}' run; refit needs a "
                             "locate run")
    settings = dict(config["settings"])
    if alpha is not None:
        _check_alpha(alpha)
        settings["alpha"] = alpha
    num_layers, num_heads = config["layers"], config["heads_per_layer"]
    if top_k is not None:
        _check_positive_int("--top-k", top_k)
        if top_k > num_layers * num_heads:
            raise UsageError(f"--top-k {top_k}: the model has only {num_layers * num_heads} heads")
        settings["top_k"] = top_k
    if exclude is not None:
        settings["exclude"] = format_heads(head_list(exclude, num_layers, num_heads, "--exclude"))
    matrix = np.load(folder.file("design_matrix.npy"))
    records = {r["key"]: r for r in folder.measurements()}
    missing = [k for k in ["baseline", *(f"mask-{i:04d}" for i in range(len(matrix)))]
               if k not in records]
    if missing:
        raise RunFolderError(f"{out} is incomplete ({len(missing)} measurements missing, e.g. "
                             f"{missing[0]}); rerun the locate command to finish it")
    tasks = [t.split(":")[0] for t in config["identity"]["tasks"]]
    excluded = parse_heads(settings["exclude"]) if settings.get("exclude") else []
    rankings = fit_rankings(matrix, records, tasks, num_heads, settings["alpha"], excluded)
    folder.update_config(settings=settings)
    write_locate_results(folder, rankings, settings["top_k"], folder.read_config())
    return rankings
