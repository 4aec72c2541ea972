"""What every measuring subcommand runs on: check → prepare → load → measure a plan.

``prepare`` does everything that can be done without the weights (the model's config,
the tasks built once, every head list checked against the model), so a bad argument
fails before the user waits for the model. ``run_plan`` measures the masks of a plan
that are not on disk yet, each written before the next starts.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_eval_headloc.common.checks import UsageError, check_load_args, check_number
from lm_eval_headloc.common.errors import one_line
from lm_eval_headloc.common.timing import timed
from lm_eval_headloc.distributed.workers import check_workers
from lm_eval_headloc.intervention.ablation import (
    AblationError,
    check_reference_set,
    reference_texts,
)
from lm_eval_headloc.intervention.components import (
    Component,
    Head,
    HeadSpecError,
    Neuron,
    format_heads,
    parse_components,
    parse_heads,
    read_heads_file,
)
from lm_eval_headloc.intervention.embedded import (
    local_pretrained,
    recorded_model_args,
    smollm2_model_args,
)
from lm_eval_headloc.intervention.geometry import Geometry, UnsupportedGeometry
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.measurement.metrics import (
    TASK_METRICS,
    MetricError,
    default_metric,
    metrics_of_task,
    parse_task_metric,
    tag_metric,
)
from lm_eval_headloc.measurement.signals import check_gold_answers
from lm_eval_headloc.method.columns import Columns
from lm_eval_headloc.runs.folder import RunFolder, RunFolderError
from lm_eval_headloc.runs.record import RunRecord, measured_on, start_run
from lm_eval_headloc.runs.spec import RunSpec, parse_examples_part, parse_gen_kwargs, path_list
from lm_eval_headloc.tasks import check_task_names, load_failure, make_task_manager

if TYPE_CHECKING:
    from lm_eval_headloc.measurement.measure import Measurement

__all__ = ["NoEffectError", "PlanEntry", "Setup", "check_candidates", "check_design_budget",
           "check_task_overrides", "head_list", "load_model", "measured_plan",
           "open_measurement", "prepare", "run_plan", "set_ablation"]

log = logging.getLogger("lm_eval_headloc")

# A design matrix is held in memory and saved as one bool array; refuse budgets past this.
MAX_DESIGN_BYTES = 256 * 2**20
#: Rows per forward pass where --batch-size is not given (generation on a GPU aside:
#: ``generation_batch``).
DEFAULT_BATCH_SIZE = 32


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
    return recorded_model_args(model_args)  # the embedded model by its name, not its folder


#: The model args that say which files a config or tokenizer is read from.
_FILE_ARGS = ("revision", "trust_remote_code", "gguf_file", "subfolder")


def model_config(model_args: str) -> Any:
    """The Hugging Face config ``model_args`` name (its ``pretrained=``, ``revision=``,
    ``gguf_file=`` …), no weights loaded; a one-line ``UsageError`` when it cannot be
    read."""
    from lm_eval.utils import simple_parse_args_string
    from transformers import AutoConfig

    from lm_eval_headloc.intervention.gguf_reads import cached_gguf_reads

    args = simple_parse_args_string(model_args)
    kwargs = {k: args[k] for k in _FILE_ARGS if k in args}
    pretrained = local_pretrained(args.get("pretrained"))
    check_load_args(pretrained, args.get("dtype"), args.get("peft"), args.get("gguf_file"))
    pretrained = str(pretrained)
    try:
        with cached_gguf_reads():  # the load after this check reuses the parse
            return AutoConfig.from_pretrained(pretrained, **kwargs)
    except Exception as err:  # noqa: BLE001 — any loading failure is the user's model path
        raise UsageError(f"cannot read the config of pretrained={pretrained!r}: "
                         f"{one_line(err)}") from None


#: The weight files a model folder loads from, besides its config.json.
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
#: How much of each file's start and end the fingerprint reads.
_SAMPLED = 2**20


def model_fingerprint(model_args: str) -> str | None:
    """What identifies a model loaded from a local folder wherever the folder lies: a hash
    of the names and sizes of the files it loads from (its ``gguf_file=``, else config.json
    and the weights) and of each one's first and last MiB, where the weights of two
    fine-tunes of one model differ. None for a Hub model, named by its id wherever it
    runs. Read in milliseconds: no weights are loaded."""
    import hashlib
    import os

    from lm_eval.utils import simple_parse_args_string

    args = simple_parse_args_string(model_args)
    folder = local_pretrained(args.get("pretrained"))
    if not (isinstance(folder, str) and os.path.isdir(folder)):
        return None
    folder = Path(folder, str(args.get("subfolder") or ""))
    files = [folder / str(args["gguf_file"])] if args.get("gguf_file") else [
        folder / "config.json", *sorted(p for pattern in _WEIGHTS for p in folder.glob(pattern))]
    digest, read = hashlib.sha256(), 0
    for path in files:
        if not path.is_file():
            continue
        read += 1
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as file:
            digest.update(file.read(_SAMPLED))
            file.seek(max(size - _SAMPLED, 0))
            digest.update(file.read(_SAMPLED))
    return f"sha256:{digest.hexdigest()}" if read else None


def config_geometry(config: Any) -> Geometry:
    """The model's layers, query heads per layer and MLP width (``Geometry``) from its
    config alone: no weights loaded, so component names are checked in seconds."""
    try:
        return Geometry.from_config(config)
    except (AttributeError, UnsupportedGeometry) as err:
        raise UsageError(f"pretrained={config.name_or_path!r}: {err}") from None


def context_length(model_args: str, config: Any) -> int | None:
    """The most tokens the model takes, prompt and generation together, as lm-eval's HF
    model resolves it: ``max_length=`` in the model args, else the config's (None where
    the config does not say: then the tokenizer's, known once it loads)."""
    from lm_eval.models.utils import resolve_max_length
    from lm_eval.utils import simple_parse_args_string

    given = simple_parse_args_string(model_args).get("max_length")
    if given is not None:
        return check_number(given, "max_length", whole=True, min_val=1)
    return resolve_max_length(config, None, default=0) or None


def check_chat_template(model_args: str) -> None:
    """``--apply-chat-template`` needs a tokenizer with a chat template (a base model's
    has none): read from the tokenizer alone, before any weights load (transformers would
    say so only when the first prompt is built)."""
    from lm_eval.utils import simple_parse_args_string
    from transformers import AutoTokenizer

    from lm_eval_headloc.intervention.gguf_reads import cached_gguf_reads

    args = simple_parse_args_string(model_args)
    source = local_pretrained(args.get("tokenizer") or args.get("pretrained"))
    kwargs = {k: args[k] for k in _FILE_ARGS if k in args and not args.get("tokenizer")}
    try:
        with cached_gguf_reads():
            tokenizer = AutoTokenizer.from_pretrained(str(source), **kwargs)
    except Exception:  # noqa: BLE001 — the load reports an unreadable tokenizer itself
        return
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--apply-chat-template: the tokenizer of {source} has no chat "
                         "template (a base model's has none); leave the flag out")


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
        if _names_a_file(spec):
            names = read_heads_file(Path(spec))  # a path: "not found", not "bad name"
        if not neurons:
            return list(parse_heads(names, num_layers, heads_per_layer,
                                    head_layers=head_layers))
        return parse_components(names, num_layers, heads_per_layer, neurons_per_layer,
                                head_layers=head_layers)
    except HeadSpecError as err:
        hint = "" if neurons or not _names_a_neuron(names) else (
            " (neurons are kept out by a locate or sweep that locates them: --components "
            "neurons or heads+neurons)")
        raise UsageError(f"{what}: {err}{hint}") from None


def _names_a_file(spec: str) -> bool:
    """Whether ``spec`` names a head file rather than heads: an existing path, a .json or
    .txt name, or one with a folder in it."""
    path = Path(spec)
    try:
        exists = path.exists()
    except OSError:  # a list of hundreds of heads is too long to be a file's name
        exists = False
    return exists or path.suffix.lower() in (".json", ".txt") or "/" in spec


def _names_a_neuron(names: Any) -> bool:
    try:
        return any(isinstance(c, Neuron) for c in parse_components(names))
    except HeadSpecError:
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
        if not path_part.strip().lower().endswith((".yaml", ".yml")):
            names.append(task)
            continue
        path = Path(path_part.strip())
        if not path.is_file():
            raise UsageError(f"--tasks {task}: no such task file")
        try:
            config = load_yaml(str(path), resolve_func=False)
        except Exception as err:  # noqa: BLE001 — any unreadable YAML is the user's file
            raise UsageError(f"--tasks {task}: cannot read it ({one_line(err)})") from None
        name = config.get("task") or config.get("group") if isinstance(config, dict) else None
        if not isinstance(name, str):
            raise UsageError(f"--tasks {task}: the file names no task (no 'task:' or "
                             "'group:' key holding one name)")
        names.append(name + sep + metric)
        folders.append(str(path.resolve().parent))
    return names, folders


@timed("tasks and checks")
def prepare(spec: RunSpec, extra_tasks: Sequence[str] = ()) -> Setup:
    """Check the spec, the model (config only, no weights), the tasks (built once: names,
    metrics, whether they run model-written code) and every head list — all before any
    weights load. ``extra_tasks`` are measured too (verify's general tasks)."""
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
        joined = _join_metric_filters([*spec.tasks, *extra_tasks], manager.all_tasks)
        specs = [parse_task_metric(t) for t in joined]
        check_task_names(manager, [name for name, _ in specs])
    except ValueError as err:
        raise UsageError(str(err)) from None
    model_args = resolve_model_args(spec.model_args)
    config = model_config(model_args)
    if spec.apply_chat_template:
        check_chat_template(model_args)
    geometry = config_geometry(config)
    num_layers, heads_per_layer = geometry.num_layers, geometry.heads_per_layer
    if len({name for name, _ in specs}) != len(specs):
        raise UsageError(f"--tasks {','.join(joined)}: a task is named twice")
    from lm_eval_headloc.measurement.measure import seed_as_lm_eval

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
        if metric is not None:
            produced = sorted({key for task in leaves for key in metrics_of_task(task)})
            if metric not in produced:
                raise UsageError(f"task {name!r} produces no metric {metric!r}; it produces: "
                                 f"{', '.join(produced)}")
        elif (spec.signal == "metric" and name not in TASK_METRICS
              and not loaded[name]["groups"] and len(leaves) > 1):
            # A tag (no score of its own): the mean of its tasks, by the one metric they
            # are scored by, decided here (refused here where they differ).
            try:
                chosen = tag_metric(name, {task: default_metric(task, built) for task, built
                                           in loaded[name]["tasks"].items()})
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
    check_task_overrides(spec, loaded, context_length(model_args, config))
    own = joined[:len(joined) - len(extra_tasks)] if extra_tasks else joined
    resolved = spec.replace(model_args=model_args, tasks=tuple(own),
                            include_path=tuple(path_list(spec.include_path)))
    total = geometry.total_heads
    columns = _column_count(spec, geometry)
    if spec.top_k > columns:
        raise UsageError(f"--top-k {spec.top_k}: the model has only {total} heads"
                         if spec.components == "heads" else
                         f"--top-k {spec.top_k}: the run ranks only {columns} components")
    exclude, never = (head_list(value, num_layers, heads_per_layer, flag,
                                neurons="neurons" in spec.components,
                                neurons_per_layer=geometry.neurons_per_layer,
                                head_layers=geometry.head_layers)
                      for value, flag in ((spec.exclude, "--exclude"),
                                          (spec.never_ablate, "--never-ablate")))
    excluded_heads = {h for h in exclude if isinstance(h, Head)}
    never_heads = {h for h in never if isinstance(h, Head)}
    if "heads" in spec.components.split("+") and len(excluded_heads | never_heads) >= total:
        which = ("--never-ablate covers" if len(never_heads) >= total else "--exclude covers"
                 if len(excluded_heads) >= total else
                 "--exclude and --never-ablate together cover")
        raise UsageError(f"{which} every head ({total}); nothing is left to rank")
    if "neurons" in spec.components:
        check_candidates(_candidate_count(spec, geometry), geometry.total_neurons,
                         sum(isinstance(c, Neuron) for c in never))
    # --masks left out is the default budget's split, which both checks below pass.
    if spec.masks is not None:
        check_design_budget(spec.design_rows, columns,
                            "--max-masks" if spec.masks == "auto" else "--masks")
    if spec.sparsity == "auto" and spec.components == "heads" and spec.masks is not None:
        from lm_eval_headloc.method.pilot import pilot_design

        heads = Columns.heads(num_layers, heads_per_layer, geometry.head_layers)
        never_flat = [heads.index(h) for h in never]
        pilot = len(pilot_design(total, spec.masks_seed, never_flat)[0])
        if spec.design_rows <= pilot:
            flag = "--max-masks" if spec.masks == "auto" else "--masks"
            raise UsageError(f"{flag} {spec.design_rows}: --sparsity auto's pilot alone takes "
                             f"{pilot} measurements; give more")
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


class NoEffectError(UsageError):
    """An option that would change nothing for the measured tasks (``cross`` leaves out
    such an option it took from its runs rather than refuse it)."""


def check_task_overrides(spec: RunSpec, loaded: Mapping[str, Any],
                         context: int | None = None) -> None:
    """Refuse --num-fewshot and --gen-kwargs where they would change nothing or fail once
    the model is loaded (more few-shot examples than a task can draw, more new tokens than
    the model's ``context``), and generation arguments no model's ``generate`` takes —
    before any weights load (``loaded``: each task name -> what ``TaskManager.load``
    built)."""
    leaves = {leaf: task for entry in loaded.values() for leaf, task in entry["tasks"].items()}
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
            try:  # lm-eval draws n + 1 (the question itself may be among them)
                pool = len(task.fewshot_docs()) if leaf not in fixed else None
            except TypeError:  # a pool without a length: lm-eval's to judge
                pool = None
            if pool is not None and spec.num_fewshot + 1 > pool:
                raise UsageError(f"--num-fewshot {spec.num_fewshot}: task {leaf!r} has "
                                 f"{pool} documents to draw few-shot examples from, and "
                                 f"lm-eval draws one more than it uses; at most {pool - 1}")
    gen_kwargs = parse_gen_kwargs(spec.gen_kwargs)
    if gen_kwargs is None:
        return
    tokens = gen_kwargs.get("max_gen_toks")
    if tokens is not None and context is not None and tokens >= context:
        raise UsageError(f"--gen-kwargs max_gen_toks={tokens}: the model takes {context} "
                         "tokens, prompt and generation together; give fewer")
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

@timed("model load")
def load_model(setup: Setup) -> Any:
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    # The kind is set once the reference set is known (open_measurement); the scale now.
    batch_size = setup.spec.batch_size
    return HFHeadAblateLM.create_from_arg_string(
        setup.spec.model_args, {"batch_size": DEFAULT_BATCH_SIZE if batch_size is None
                                else batch_size, "scale": setup.spec.scale})


@timed("measurement set-up")
def open_measurement(setup: Setup, lm: Any, folder: RunFolder | None = None,
                     num_samples: int | None = None, limit: int | None = None, *,
                     run: RunRecord | None = None) -> Any:
    """The measurement of ``setup``'s tasks on ``lm`` (a task with fewer documents than
    asked for is said in the log). What it is made on (``result.measured_on``: the
    example subset, the geometry, the ablation) goes into ``run``, the command's record,
    which writes it with its phase; without one, into ``folder``'s config.json at once
    (for scripts that keep no record). ``folder`` also holds mean ablation's cache."""
    from lm_eval_headloc.measurement.measure import HarnessMeasurement

    spec = setup.spec
    measure = HarnessMeasurement(
        lm, setup.tasks, setup.loaded, num_samples=num_samples, seed=spec.seed,
        apply_chat_template=spec.apply_chat_template, num_fewshot=spec.num_fewshot,
        gen_kwargs=parse_gen_kwargs(spec.gen_kwargs), system_instruction=spec.system_instruction,
        confirm_run_unsafe_code=spec.confirm_run_unsafe_code, limit=limit,
        verbose=spec.verbose, signal=spec.signal,
        examples_part=parse_examples_part(spec.examples_part),
        generation_batch=generation_batch(spec, lm))
    _say_short_tasks(measure, num_samples)
    measure.ablation_config = set_ablation(setup, lm, measure.subset, folder)
    if run is not None:
        run.measured_with(setup, measure)
    elif folder is not None:
        folder.update_config(**measured_on(setup, measure))
    if spec.workers > 1:
        from lm_eval_headloc.distributed.workers import start_workers

        measure = start_workers(setup, measure, num_samples=num_samples, limit=limit,
                                extra_tasks=setup.task_names[len(setup.run_task_names):])
    return measure


def generation_batch(spec: RunSpec, lm: Any) -> str | None:
    """Rows per mask of a generation task's ``generate`` calls: with no --batch-size on a
    GPU, every example where memory allows ("auto"; a generating step costs about as much
    for 100 rows as for 32 there), else the model's batch size (None)."""
    import torch

    if spec.batch_size is None and torch.device(lm.device).type == "cuda":
        return "auto"
    return None


def set_ablation(setup: Setup, lm: Any, subset: Mapping[str, list[int]] | None,
                 folder: RunFolder | None = None) -> dict[str, Any]:
    """Put ``setup``'s ablation kind on ``lm``: mean and resample take their reference
    examples from --ablation-data, or else from the run's own tasks on ``subset``; mean's
    statistics are cached in ``folder`` (``means/``). Returns what was used, for the
    run's config.json."""
    spec = setup.spec
    if spec.ablation == "zero":
        lm.set_ablation("zero")
        texts, source = None, None
    else:
        texts = setup.reference_texts(subset)
        source = spec.ablation_data or ("the run's tasks on its example subset: "
                                        + ",".join(setup.run_task_names))
        if spec.ablation_field is not None:
            source += f" (field {spec.ablation_field!r})"
        try:
            lm.set_ablation(spec.ablation, texts,
                            None if folder is None else folder.file("means"),
                            spec.ablation_data, spec.ablation_field)
        except AblationError as err:
            raise UsageError(f"--ablation {spec.ablation}: {err}") from None
    used = {"kind": spec.ablation, "scale": spec.scale, "reference": source,
            "reference_examples": None if texts is None else len(texts),
            "reference_digest": lm.reference_digest, "means_file": lm.means_file,
            "resample_seed": lm.resample_seed if spec.ablation == "resample" else None}
    return used


def _say_short_tasks(measure: Any, num_samples: int | None) -> None:
    """Say when a task has fewer documents than ``num_samples`` asked for."""
    if num_samples is None:
        return
    for task, count in sorted(dict(measure.examples_used).items()):
        if count < num_samples:
            log.warning("%s has only %d documents; all %d are used (--num-samples %d)",
                        task, count, count, num_samples)


def _scale_words(scale: float | None) -> str:
    return "the run's scale" if scale is None else f"scale {scale:g}"


#: A plan entry: (key, heads), or (key, heads, scale) for heads knocked out at ``scale``
#: rather than at the measurement's own (the run's --scale).
PlanEntry = tuple[str, list[Head]] | tuple[str, list[Head], float | None]


@contextlib.contextmanager
def phase_bar(desc: str, total: int, done: int = 0, progress: bool = True) -> Iterator[Any]:
    """One progress bar for a phase that measures in several calls of ``run_plan`` (the
    confirmation's rounds, ``--masks auto``'s), as lm-eval draws one per request type:
    pass it as their ``bar``; each advances it by what it measures. ``done``: what the
    phase finds on disk (a resumed run). A phase that ends short of ``total`` (it
    stopped early) ends at 100 % of what it measured."""
    from tqdm import tqdm

    bar = tqdm(total=total, initial=min(done, total), desc=desc, unit="meas",
               disable=not progress, dynamic_ncols=True)
    try:
        yield bar
        if bar.n < bar.total:
            bar.total = bar.n
            bar.refresh()
    finally:
        bar.close()


@timed("measurements")
def run_plan(folder: RunFolder, measure: Measurement | None, plan: Sequence[PlanEntry],
             desc: str, progress: bool = True, masks_per_pass: int | None = 1,
             bar: Any = None) -> dict[str, dict[str, Any]]:
    """Measure every (key, heads) not yet on disk; return all records by key (``measure``
    None: nothing may be left to measure).

    Each record is appended (and fsynced) before the next measurement (or, with
    ``masks_per_pass`` K > 1, the next pass of K masks) starts, so an interrupted run
    loses at most the work in flight. ``masks_per_pass=None``: the measurement's choice.
    An entry ``(key, heads, scale)`` is measured at that scale (verify's and cross's
    erase beside an enhance) and its record holds ``scale``; an entry without one, at the
    measurement's own scale, which the run's identity fixes. A record on disk whose mask
    or scale differs from the plan's refuses the folder. config.json is not touched: a
    distributed measurement's workers go into the command's record with its next phase
    (``RunRecord.save``). ``bar``: the phase's (``phase_bar``), advanced by what this call
    measures; None: a bar of this plan's own (``desc``, shown unless ``progress`` is
    False).
    """
    entries = [(key, heads, rest[0] if rest else None) for key, heads, *rest in plan]
    done = {r["key"]: r for r in folder.measurements()}
    for key, heads, scale in entries:
        if key not in done:
            continue
        if done[key]["mask"] != format_heads(heads):
            raise RunFolderError(
                f"{folder.path}: measurement {key!r} on disk knocked out "
                f"{done[key]['mask'] or 'nothing'}, this run plans "
                f"{format_heads(heads) or 'nothing'}; the folder was made with other arguments "
                "(use another --out or --force)")
        wanted = None if scale is None else float(scale)
        if done[key].get("scale") != wanted:
            raise RunFolderError(
                f"{folder.path}: measurement {key!r} on disk was made at "
                f"{_scale_words(done[key].get('scale'))}, this run plans "
                f"{_scale_words(wanted)}; the folder was made with other arguments (use "
                "another --out or --force)")
    # A knockout planned twice (two tasks' top-k that are the same heads, a set two runs
    # found) is measured once: a measurement is deterministic, so the second key's record
    # is the first's, said by "same_as".
    first_of: dict[tuple[str, float | None], str] = {}
    for key, heads, scale in entries:
        if key in done:
            first_of.setdefault(_knockout_of(heads, scale), key)
    todo, waiting = [], []  # waiting: (twin's key, its first's key), in plan order
    for key, heads, scale in entries:
        if key in done:
            continue
        first = first_of.setdefault(_knockout_of(heads, scale), key)
        if first == key:
            todo.append((key, heads, scale))
        else:
            waiting.append((key, first))
    position = {key: index for index, (key, _, _) in enumerate(entries)}

    def copy_twins(final: bool = False) -> None:
        # In plan order: each twin once every entry planned before it is on disk.
        if not waiting:  # the usual case, once a measurement: nothing to scan
            return
        horizon = min((position[key] for key, _, _ in todo if key not in done),
                      default=len(entries))
        while waiting and (final or position[waiting[0][0]] < horizon):
            key, first = waiting.pop(0)
            done[key] = _twin_record(folder, key, done[first])
            bar.update(1)

    if todo and measure is None:
        raise ValueError(f"run_plan: {len(todo)} measurements left and no measurement")
    if masks_per_pass is None:
        masks_per_pass = measure.auto_masks_per_pass() if todo else 1
    if bar is None:
        phase = phase_bar(desc, len(entries), sum(key in done for key, _, _ in entries),
                          progress)
    else:
        phase = contextlib.nullcontext(bar)
    with phase as bar:
        copy_twins()  # those planned before anything left to measure
        # One scale per call of measure_chunks: entries grouped by scale, in plan order.
        for scale in dict.fromkeys(entry[2] for entry in todo):
            group = [entry for entry in todo if entry[2] == scale]
            chunks = [group[start:start + masks_per_pass]
                      for start in range(0, len(group), masks_per_pass)]
            at = {} if scale is None else {"scale": float(scale)}
            # Chunks may complete in any order (--workers); each is written as it arrives.
            results = measure.measure_chunks([[h for _, h, _ in c] for c in chunks],
                                             masks_per_pass, **at)
            for index, all_scores, seconds in results:
                for (key, heads, _), scores in zip(chunks[index], all_scores, strict=True):
                    record = {
                        "key": key, "mask": format_heads(heads), "num_knocked_out": len(heads),
                        **at,
                        "scores": {name: s.value for name, s in scores.items()},
                        "metrics": {name: s.metric for name, s in scores.items()},
                        "higher_is_better": {name: s.higher_is_better
                                             for name, s in scores.items()},
                        "seconds": round(seconds, 4),
                    }
                    logprob = {name: s.logprob for name, s in scores.items()
                               if s.logprob is not None}
                    if logprob:  # the gold answers' log-likelihood, measured along the way
                        record["logprob"] = logprob
                    folder.append_measurement(record)
                    done[key] = record
                    bar.update(1)
                    copy_twins()
        copy_twins(final=True)
    return {key: done[key] for key, _, _ in entries}


def _knockout_of(heads: Sequence[Head], scale: float | None) -> tuple[str, float | None]:
    """What a plan entry measures: its mask and scale (None: the measurement's own)."""
    return format_heads(heads), None if scale is None else float(scale)


def _twin_record(folder: RunFolder, key: str, measured: Mapping[str, Any]) -> dict[str, Any]:
    """``key``'s record, copied from ``measured``, the same knockout's, and appended."""
    record = {**measured, "key": key, "same_as": measured.get("same_as", measured["key"])}
    folder.append_measurement(record)
    return record


@contextlib.contextmanager
def measured_plan(out: str | Path, command: str, spec: RunSpec, setup: Setup,
                  plan: Sequence[PlanEntry], *, identity: Mapping[str, Any],
                  protect: Sequence[str | Path] = (), force: bool = False,
                  num_samples: int | None = None, limit: int | None = None,
                  desc: str | None = None
                  ) -> Iterator[tuple[RunFolder, dict[str, dict[str, Any]]]]:
    """Start (or resume) ``command``'s run folder ``out``, load the model once, measure
    ``plan`` (``run_plan``) and hold the folder's lock while the caller writes its
    tables from the records: ``with measured_plan(...) as (folder, records):``. The
    commands that knock out given sets (verify, cross) share this."""
    if spec.output_path is not None:
        from lm_eval_headloc.measurement.lm_eval_output import (
            check_output_folder,
            make_output_folder,
        )

        check_output_folder(spec.output_path)
    with RunFolder(out) as folder:
        # Phases: started, measuring, and (with --workers) measured: their shares.
        record = start_run(folder, command, spec, force=force, protect=protect,
                           identity=identity, fingerprint=setup.model_fingerprint)
        if spec.output_path is not None:  # made once the run folder is known to be fine
            make_output_folder(spec.output_path)
        if nothing_left(folder, plan, spec.output_path, spec.log_samples):
            # A finished run rerun: its tables come from disk, no weights loaded (run_plan
            # still checks that what is on disk is what the plan asks for).
            yield folder, run_plan(folder, None, plan, desc=desc or command, progress=False)
            return
        measure = open_measurement(setup, load_model(setup), folder, num_samples=num_samples,
                                   limit=limit, run=record)
        record.save(folder, measure)
        records = run_plan(folder, measure, plan, desc=desc or command,
                           progress=spec.progress)
        if spec.output_path is not None:
            write_lm_eval_results(folder, measure, setup, plan)
        record.save(folder, measure)  # the workers' shares and the timings so far
        yield folder, records


#: The run folder's index of the lm-eval results files ``--output-path`` wrote.
LM_EVAL_FILES = "lm_eval_files.json"


def nothing_left(folder: RunFolder, plan: Sequence[PlanEntry],
                 output_path: str | None = None, log_samples: bool = False) -> bool:
    """Every measurement of ``plan`` is on disk (and, with ``output_path``, every lm-eval
    results file --output-path wants for it), so the model is not needed."""
    done = {record["key"] for record in folder.measurements()}
    if any(entry[0] not in done for entry in plan):
        return False
    if output_path is None:
        return True
    index = folder.file(LM_EVAL_FILES)
    written = json.loads(index.read_text()) if index.is_file() else {}
    return all(_files_written(written.get(entry[0]), output_path, log_samples)
               for entry in plan)


def _files_written(entry: Any, output_path: str, log_samples: bool) -> bool:
    """An index entry (one path, or a list of them: one per chat-template setting) whose
    every file is on disk under ``output_path`` (a rerun with another --output-path writes
    there), with its samples beside it where ``log_samples`` wants them (a rerun that adds
    --log-samples writes them)."""
    paths = [entry] if isinstance(entry, str) else entry
    if not (isinstance(paths, list) and paths and all(isinstance(p, str) for p in paths)):
        return False
    from lm_eval_headloc.measurement.lm_eval_output import results_folder

    root = results_folder(output_path).resolve()
    for path in map(Path, paths):
        if not path.is_file() or root not in path.resolve().parents:
            return False
        # lm-eval names a save's files with one date id (results_<id>.json, and
        # samples_<task>_<id>.jsonl beside it).
        date_id = path.stem.rsplit("_", 1)[-1]
        if log_samples and not any(path.parent.glob(f"samples_*_{date_id}.jsonl")):
            return False
    return True


@timed("lm-eval results files")
def write_lm_eval_results(folder: RunFolder, measure: Any, setup: Setup,
                          plan: Sequence[PlanEntry]) -> None:
    """``--output-path``: each knockout of ``plan`` evaluated again by lm-eval itself, on the
    same examples and prompts, and saved as lm-eval's CLI saves its results
    (``lm_eval_output``). A results file holds one chat-template setting, so where the
    measurement asks some tasks through the chat template (generation tasks, by default)
    and others not, each knockout gets one file per setting, as two ``lm_eval`` runs would
    write. The folder's ``lm_eval_files.json`` says which file (or files) each knockout
    went to, so a resumed run writes only the ones not written yet."""
    from lm_eval_headloc.measurement.lm_eval_output import evaluate_knockout, save_lm_eval_results

    spec = setup.spec
    index_path = folder.file(LM_EVAL_FILES)
    written = json.loads(index_path.read_text()) if index_path.is_file() else {}
    manager = make_task_manager(list(spec.include_path))
    window = ({"samples": measure.subset} if measure.subset is not None
              else {"limit": measure.limit})
    settings = chat_settings(measure, [name for name, _ in setup.tasks])
    gen_kwargs = parse_gen_kwargs(spec.gen_kwargs)
    files_of: dict[tuple[str, float | None], Any] = {}  # one evaluation a knockout
    for key, components, *scale in plan:
        knockout = _knockout_of(components, scale[0] if scale else None)
        if _files_written(written.get(key), str(spec.output_path), spec.log_samples):
            files_of.setdefault(knockout, written[key])
            continue
        if knockout in files_of:
            written[key] = files_of[knockout]
            folder.write_json(LM_EVAL_FILES, written)
            continue
        paths = []
        for chat, names in settings.items():
            with measure.generation_batch():  # --batch-size auto: the measurement's batch
                results = evaluate_knockout(
                    measure.lm, names, task_manager=manager,
                    knocked_out=list(components), scale=scale[0] if scale else None,
                    model_args=spec.model_args, log_samples=spec.log_samples,
                    apply_chat_template=chat, fewshot_as_multiturn=chat,
                    num_fewshot=spec.num_fewshot, gen_kwargs=gen_kwargs,
                    system_instruction=spec.system_instruction,
                    confirm_run_unsafe_code=spec.confirm_run_unsafe_code, **window)
            path = save_lm_eval_results(results, spec.output_path,
                                        log_samples=spec.log_samples)
            paths.append(str(path.resolve()))
        written[key] = files_of[knockout] = paths[0] if len(paths) == 1 else paths
        folder.write_json(LM_EVAL_FILES, written)


def chat_settings(measure: Any, names: Sequence[str]) -> dict[bool, list[str]]:
    """``names`` (the measurement's tasks) by whether it asks them through the chat
    template, the setting lm-eval is given for each (no template first)."""
    chat_of = {name: any(measure.chat_template[leaf] for leaf in measure.leaves_of[name])
               for name in names}
    return {chat: [name for name in names if chat_of[name] == chat]
            for chat in (False, True) if chat in chat_of.values()}
