"""A knockout's evaluation written as lm-eval writes its own: ``--output_path`` and
``--log_samples`` for ``verify`` and ``cross``.

lm-eval's CLI (``lm_eval/_cli/run.py``) hands ``simple_evaluate`` an ``EvaluationTracker``,
pops the per-document ``samples`` out of the results, then has the tracker write
``<output_path>/<model_name_sanitized>/results_<date>.json`` (or, for an output path
ending in ``.json``, ``<stem>_<date>.json`` beside it) and, with ``--log_samples``,
``samples_<task>_<date>.jsonl`` for each task next to it. ``save_lm_eval_results`` does
exactly that with the same tracker, so what reads lm-eval's result folders (``lm_eval.utils``'
``get_results_filenames``, ``get_latest_filename`` …, which its Hub logger lists a folder
with; ``datasets.load_dataset("json", …)``, which it loads the files with) takes a
knockout for any evaluation.

What differs is the model's name: lm-eval names an evaluation after its ``pretrained=``
argument, so every knockout of one model would share the plain model's folder.
``knockout_model_name`` adds what was knocked out (``pythia-14m,ablate=L0H1+L3H2``; with
nothing knocked out ``pythia-14m,ablate=none``, so a run's baseline is not filed with a
plain ``lm_eval --model hf`` run of the model); its folder is lm-eval's sanitization of that
name. ``evaluate_knockout`` runs lm-eval's
``simple_evaluate`` on a loaded ``hf-headablate`` model with some components knocked out
and records the results as the CLI would have for ``--model hf-headablate --model_args
pretrained=…,ablate=…``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.files import not_a_file, write_atomically
from lm_eval_headloc.intervention.components import Component, component_tokens, format_heads
from lm_eval_headloc.intervention.registration import MODEL_NAME

log = logging.getLogger(__name__)

__all__ = ["evaluate_knockout", "knockout_model_args", "knockout_model_name",
           "check_output_folder", "make_output_folder", "save_lm_eval_results",
           "save_reference_set"]

#: Longest component list a model name spells out; a longer one (a neuron group's
#: hundreds of neurons) is cut to its first components, how many more, and a hash.
MAX_LISTED = 64
#: Hex digits of the SHA-256 of the whole (sorted) list kept in a shortened name.
HASH_DIGITS = 12
#: The model arguments a knockout's own ``ablate=`` (and ``scale=``) replace.
_KNOCKOUT_ARGS = ("ablate", "ablate_file", "ablate_top", "scale")
_WILDCARD = re.compile(r"^L\d+[HN]\*$", re.ASCII)
#: What a name says was knocked out when nothing was (no component is named so).
NOTHING = "none"


def _component_list(knocked_out: Sequence[str | Component] | str) -> str:
    """``knocked_out`` as ``format_heads`` writes it: sorted and unique, so the same set
    in another order names the same model. Whole layers (``L3H*``) stay as written: no
    model is at hand to expand them."""
    tokens = [t for t in component_tokens(knocked_out) if not isinstance(t, str) or t.strip()]
    wild = sorted({t.strip() for t in tokens if isinstance(t, str) and _WILDCARD.match(t.strip())})
    named = [t for t in tokens if not (isinstance(t, str) and t.strip() in wild)]
    listed = format_heads(named) if named else ""  # parsed, sorted, unique
    return "+".join(part for part in (listed, *wild) if part)


def _shortened(components: str) -> str:
    """``components`` whole when at most ``MAX_LISTED`` characters, else its first
    components, ``+<n>more`` and a hash of the whole list: ``L0N1+L0N2+…+93more-3fa9c0d1e2b4``
    (the hash keeps two lists with the same start apart; it is stable across runs)."""
    if len(components) <= MAX_LISTED:
        return components
    names = components.split("+")
    digest = hashlib.sha256(components.encode()).hexdigest()[:HASH_DIGITS]
    shown: list[str] = []
    for name in names:  # room for the tail: "+9999more-" and the hash
        if len("+".join([*shown, name])) > MAX_LISTED - len("+9999more-") - HASH_DIGITS:
            break
        shown.append(name)
    return "+".join([*shown, f"{len(names) - len(shown)}more-{digest}"])


def _as_dict(model_args: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Model arguments as the lm-eval CLI holds them: a dict (its ``key_val_to_dict``)."""
    if model_args is None:
        return {}
    if isinstance(model_args, Mapping):
        return dict(model_args)
    return cli_args_dict(model_args)


def cli_args_dict(text: str) -> dict[str, Any]:
    """``key=value,...`` read as the ``lm_eval`` command reads ``--model_args`` and
    ``--gen_kwargs`` (its ``key_val_to_dict``: values are Python literals where they parse
    as one, lists and quotes kept whole). ``ValueError`` where a part has no ``=``."""
    from lm_eval._cli.utils import key_val_to_dict

    return key_val_to_dict(text)


def _scale_text(scale: float) -> str:
    return format(float(scale), "g")  # 2.0 -> "2", 0.5 -> "0.5"


def knockout_model_args(model_args: str | Mapping[str, Any] | None,
                        knocked_out: Sequence[str | Component] | str,
                        scale: float | None = None) -> dict[str, Any]:
    """``hf-headablate``'s model arguments for this knockout, as lm-eval's CLI records
    them (a dict): ``model_args`` with its ``ablate=``/``ablate_file=``/``ablate_top=``
    replaced by ``ablate=<knocked_out>`` (none when nothing is knocked out) and ``scale=``
    by ``scale`` (None: as ``model_args`` say; left out at 0, the default, and with
    nothing knocked out: a scale of no component would be warned of as a knockout that
    knocks out nothing)."""
    args = _as_dict(model_args)
    scale = float(args.get("scale", 0.0)) if scale is None else float(scale)
    args = {key: value for key, value in args.items() if key not in _KNOCKOUT_ARGS}
    components = _component_list(knocked_out)
    if components:
        args["ablate"] = components
    if components and scale != 0.0:
        args["scale"] = int(scale) if scale.is_integer() else scale
    return args


def knockout_model_name(model_args: str | Mapping[str, Any] | None,
                        knocked_out: Sequence[str | Component] | str,
                        scale: float | None = None) -> str:
    """The ``model_name`` lm-eval records for a knockout evaluation, which also names its
    results folder (``sanitize_model_name`` of it).

    lm-eval's own name for ``model_args`` (its ``pretrained=``, or ``peft=``/``delta=``
    where given) followed by what was knocked out in model-argument syntax:
    ``EleutherAI/pythia-14m,ablate=L0H1+L3H2``, ``…,ablate=L3N5,scale=2`` at a scale that
    is not 0, ``…,ablation=mean`` for an ablation kind that is not zero. A list longer
    than ``MAX_LISTED`` characters is shortened with a hash of the whole list
    (``_shortened``); the results file's ``config.model_args`` keeps it whole. With
    nothing knocked out: ``EleutherAI/pythia-14m,ablate=none`` (the model's own name is a
    plain ``lm_eval --model hf`` run's folder, and this evaluation is not that run).
    ``scale`` None: as ``model_args`` say."""
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker

    args = _as_dict(model_args)
    # The name lm-eval itself gives these arguments (the plain model's folder).
    base = GeneralConfigTracker._get_model_name(args) or "model"
    components = _component_list(knocked_out)
    if not components:
        return f"{base},ablate={NOTHING}"
    parts = [base, f"ablate={_shortened(components)}"]
    if str(args.get("ablation", "zero")) != "zero":
        parts.append(f"ablation={args['ablation']}")
    scale = float(args.get("scale", 0.0)) if scale is None else float(scale)
    if scale != 0.0:
        parts.append(f"scale={_scale_text(scale)}")
    return ",".join(parts)


def _name_from_results(results: Mapping[str, Any], model_args: Any) -> str:
    """The knockout's name from a results dict's ``config`` (``hf-headablate``'s model
    info says what it knocked out and at which scale; a model handed to
    ``simple_evaluate`` loaded has no model arguments, only its ``config.model``)."""
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker

    config = results.get("config") or {}
    if GeneralConfigTracker._get_model_name(model_args) is None and config.get("model"):
        model_args = {**_as_dict(model_args), "pretrained": str(config["model"])}
    return knockout_model_name(model_args, config.get("ablate") or "", config.get("scale"))


def results_folder(output_path: str | Path) -> Path:
    """The folder lm-eval writes its results files in for ``--output_path``: the path, or
    the folder of a ``.json`` name (lm-eval writes beside it)."""
    path = Path(output_path)
    return path.parent if path.suffix == ".json" else path


def check_output_folder(output_path: str | Path) -> None:
    """Refuse in one line an ``output_path`` whose folder could not be made or written,
    creating nothing (``make_output_folder`` makes it once the run folder is taken)."""
    from lm_eval_headloc.common.checks import UsageError

    folder = results_folder(output_path).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    problem = ("Not a directory" if not existing.is_dir() else
               "Permission denied" if not os.access(existing, os.W_OK | os.X_OK) else None)
    if problem:
        raise UsageError(f"--output-path {output_path}: cannot write there ({problem})")


def make_output_folder(output_path: str | Path) -> Path:
    """Create the folder lm-eval writes its results files in (``output_path``, or its
    folder for a ``.json`` name) and return it: before the model loads, so a path that
    cannot be written is a one-line error now, not a traceback after the evaluation."""
    from lm_eval_headloc.common.checks import UsageError

    folder = results_folder(output_path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".headloc-write-check-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--output-path {output_path}: cannot write there "
                         f"({err.strerror or err})") from None
    return folder


def save_reference_set(output_path: str | Path, texts: Sequence[str]) -> Path:
    """Write a reference set the model was handed as texts (a run's own examples, which
    no model argument names) into ``output_path``'s results folder as a JSONL file, one
    ``{"text": …}`` a line, named by a hash of its content, and return its absolute path:
    the knockouts' recorded ``ablation_data=`` names it, so their model_args load the same
    reference set. A file of that name that holds these texts is left as it is; one that
    holds anything else is not ours, and refused (a results file would name it)."""
    from lm_eval_headloc.common.checks import UsageError

    # ASCII escapes: a raw U+2028 would split a line where the reader splits lines.
    body = "".join(json.dumps({"text": text}) + "\n" for text in texts)
    digest = hashlib.sha256(body.encode()).hexdigest()[:HASH_DIGITS]
    path = (results_folder(output_path) / f"headloc_reference_{digest}.jsonl").absolute()
    if not os.path.lexists(path):
        write_atomically(path, lambda partial: partial.write_text(body, encoding="utf-8"))
    elif (path.is_symlink() or not_a_file(path) is not None or not path.is_file()
          or path.read_bytes() != body.encode()):  # not_a_file first: a FIFO's read waits
        raise UsageError(f"--output-path: {path} exists and is not the run's reference set "
                         "as this package writes it; not overwritten: move it away")
    return path


def save_lm_eval_results(results: Mapping[str, Any], output_path: str | Path, *,
                         model_name: str | None = None,
                         model_args: str | Mapping[str, Any] | None = None,
                         log_samples: bool = False) -> Path:
    """Write ``results`` (a ``simple_evaluate`` results dict) under ``output_path`` with
    lm-eval's ``EvaluationTracker``, the calls lm-eval's CLI makes; return the results
    file's path.

    ``model_name``: the evaluation's name and folder (default: ``results["model_name"]``
    as ``evaluate_knockout`` sets it, else ``knockout_model_name`` of the results'
    ``config``); ``model_args``: what the tracker is told the model was loaded with
    (default: ``config.model_args``). ``log_samples``: also write each task's
    ``samples_<task>_<date>.jsonl`` (``results`` must hold ``samples``: evaluated with
    ``log_samples=True``). ``results`` is not changed.

    The tracker names every file with the time it writes it (to the microsecond), so a
    save never replaces an earlier one, of this knockout or another: a second save of the
    same evaluation is a second, newer file. The tracker only logs a failure to write;
    here it raises ``OSError``.
    """
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import sanitize_model_name

    results = dict(results)  # the tracker adds its fields to the dict it is given
    if model_args is None:
        model_args = (results.get("config") or {}).get("model_args")
    if model_name is None:
        model_name = results.get("model_name") or _name_from_results(results, model_args)
    samples = results.pop("samples", None)  # as the CLI does: not in the results file
    if log_samples and samples is None:
        raise ValueError("log_samples: these results hold no samples (evaluate them with "
                         "log_samples=True)")

    tracker = EvaluationTracker(output_path=str(output_path))
    general = tracker.general_config_tracker
    general.log_experiment_args(
        model_source=results.get("model_source") or MODEL_NAME,
        model_args=model_args if model_args is not None else "",
        system_instruction=results.get("system_instruction"),
        chat_template=results.get("chat_template"),
        fewshot_as_multiturn=results.get("fewshot_as_multiturn"),
    )
    general.model_name = model_name
    general.model_name_sanitized = sanitize_model_name(model_name)
    if isinstance(results.get("date"), (int, float)):
        # The evaluation's time, not the save's: its start is simple_evaluate's "date".
        general.start_time = time.perf_counter() - (time.time() - float(results["date"]))

    tracker.save_results_aggregated(results=results, samples=samples if log_samples else None)
    date_id = getattr(tracker, "date_id", None)
    path = Path(output_path)
    folder = path.parent if path.suffix == ".json" else path / general.model_name_sanitized
    written = (path.with_name(f"{path.stem}_{date_id}.json") if path.suffix == ".json"
               else folder / f"results_{date_id}.json")
    if date_id is None or not written.is_file():
        raise OSError(f"lm-eval could not write the results under {output_path} (its "
                      "EvaluationTracker logs why at INFO level)")
    if log_samples:
        for task_name in results["configs"]:
            # The tracker rewrites each sample's fields for the JSONL: give it copies.
            tracker.save_results_samples(
                task_name=task_name, samples=[dict(s) for s in samples[task_name]])
            if not (folder / f"samples_{task_name}_{date_id}.jsonl").is_file():
                raise OSError(f"lm-eval could not write {task_name}'s samples under "
                              f"{folder}")
    return written


def _batch_size_as_given(lm: Any) -> int | str:
    """``lm``'s batch size as ``--batch_size`` says it: HFLM keeps ``auto:4``'s 4 (detect
    again 4 times) apart as its ``batch_schedule``, and its ``batch_size`` is ``auto``."""
    size, schedule = lm.batch_size, getattr(lm, "batch_schedule", 1)
    return f"auto:{schedule:g}" if size == "auto" and schedule != 1 else size


def _live_ablation(lm: Any, args: Mapping[str, Any], reference: str | Path | None = None
                   ) -> dict[str, Any]:
    """What the knocked-out components became on ``lm`` where ``args`` do not say it
    (``ablation=``, its ``ablation_data=`` and ``ablation_field=``, resample's seed): the
    recorded model arguments and name must tell a mean knockout from a zero one, and load
    it. ``reference``: a JSONL file of the model's reference texts (``save_reference_set``)
    named instead of its own ``ablation_data``, which a reference set handed over as
    texts (a run's own examples) does not have."""
    if lm.ablation == "zero" or "ablation" in args:
        return {}
    live: dict[str, Any] = {"ablation": lm.ablation}
    if reference is not None:
        live["ablation_data"] = str(reference)
    elif lm.ablation_data is not None:
        live["ablation_data"] = lm.ablation_data
        if lm.ablation_field is not None:
            live["ablation_field"] = lm.ablation_field
    else:  # lm_eval would refuse these arguments ("needs a reference set")
        raise ValueError(f"ablation={lm.ablation}: the model's reference set was handed "
                         "over as texts, which no model argument names: give reference=, "
                         "the file that holds them (save_reference_set)")
    if lm.ablation == "resample" and lm.resample_seed:
        live["resample_seed"] = lm.resample_seed
    return live


#: lm-eval's ``simple_evaluate`` records the commit of the working directory's git checkout
#: with this command, its stderr the process's own.
_GIT_HASH_COMMAND = ("git", "describe", "--always")


def _gits_complaint() -> list[bytes]:
    """The lines ``_GIT_HASH_COMMAND`` writes to stderr here and now, where it fails (outside
    a git checkout: "fatal: not a git repository ..."); none where it succeeds or git is
    not installed (lm-eval's call is then silent)."""
    try:
        probe = subprocess.run(_GIT_HASH_COMMAND, capture_output=True, timeout=30,
                               check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if probe.returncode == 0:
        return []
    return [line for line in probe.stderr.splitlines() if line.strip()]


@contextlib.contextmanager
def _without_gits_complaint() -> Iterator[None]:
    """Inside, the lines git would write to stderr for lm-eval's commit lookup
    (``_gits_complaint``) are kept off the terminal, and all else written there passes
    live (lm-eval's progress bars, its log). lm-eval runs git with the process's stderr,
    so outside a git checkout each evaluation printed "fatal: not a git repository", an
    error of nothing the user did. Only where git fails: inside a checkout stderr is not
    touched."""
    complaint = _gits_complaint()
    if not complaint:
        yield
        return
    try:
        sys.stderr.flush()
        terminal = os.dup(2)
    except (OSError, ValueError):  # no stderr to speak of: nothing to keep off it
        yield
        return
    source, sink = os.pipe()
    os.dup2(sink, 2)
    os.close(sink)
    relay = threading.Thread(target=_relay, args=(source, terminal, complaint), daemon=True,
                             name="stderr without git's complaint")
    relay.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe's last writer here: the relay reads to its end
        relay.join(timeout=5)
        if not relay.is_alive():  # else a process started inside still holds the pipe
            os.close(source)
            os.close(terminal)


def _relay(source: int, target: int, dropped: Sequence[bytes]) -> None:
    """Copy ``source`` to ``target`` as it comes, less the whole lines in ``dropped``: a
    line's start that may be one of them is held until its line ends."""
    held = b""
    mid_line = False  # the current line's start was passed on: none of ``dropped``
    while chunk := os.read(source, 1 << 16):
        data, start, out = held + chunk, 0, []
        while (end := data.find(b"\n", start)) != -1:
            line = data[start:end + 1]
            if mid_line or line.rstrip(b"\r\n") not in dropped:
                out.append(line)
            mid_line, start = False, end + 1
        held = data[start:]
        if held and (mid_line or not any(line.startswith(held) for line in dropped)):
            out.append(held)  # a progress bar's "\r" update: passed on at once
            held, mid_line = b"", True
        if out:
            _write_all(target, b"".join(out))
    if held and held.rstrip(b"\r\n") not in dropped:
        _write_all(target, held)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data):]


def evaluate_knockout(lm: Any, tasks: Iterable[str], *, task_manager: Any,
                      knocked_out: Sequence[str | Component] | str,
                      limit: int | float | None = None, log_samples: bool = False,
                      scale: float | None = None,
                      model_args: str | Mapping[str, Any] | None = None,
                      reference: str | Path | None = None,
                      **kwargs: Any) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on ``lm``, a loaded ``HFHeadAblateLM``,
    with ``knocked_out`` (heads and MLP neurons) knocked out for this evaluation only
    (``knocking_out``, as every measurement of the product does) at ``scale`` (None: the
    model's own).

    Returns lm-eval's results dict, recorded as the CLI records ``--model hf-headablate
    --model_args <args>``: ``config.model`` is ``hf-headablate`` and ``config.model_args``
    those arguments (``knockout_model_args`` of ``model_args``, default the model's
    ``pretrained=``); ``model_name`` (``knockout_model_name``) and the other fields
    lm-eval's tracker writes (``model_source``, ``chat_template`` …) are set too, for
    ``save_lm_eval_results``. ``reference``: the model's mean/resample reference set as a
    JSONL file (``save_reference_set``), recorded as ``ablation_data=`` instead of the
    model's own; required where the set was handed over as texts. With nothing knocked
    out no kind or reference set acts, and the recorded arguments name none: ``config``
    says so, as a rerun of them would.
    ``kwargs`` go to ``simple_evaluate`` (``samples``, ``bootstrap_iters``,
    ``apply_chat_template`` …).
    """
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import sanitize_model_name

    from lm_eval_headloc.measurement.harness import at_scale

    if model_args is None:
        pretrained = lm.pretrained if isinstance(lm.pretrained, (str, Path)) else \
            getattr(lm.config, "_name_or_path", type(lm.model).__name__)
        model_args = {"pretrained": str(pretrained)}
    # Checked before the evaluation: its recorded arguments must load this knockout.
    live = _live_ablation(lm, _as_dict(model_args), reference) \
        if _component_list(knocked_out) else {}
    # Without an output path the tracker writes nothing: it records what simple_evaluate
    # tells it (the chat template, system instruction) for the results file.
    tracker = EvaluationTracker()
    # lm-eval records the batch size it is given to build a model; this one is built, so
    # it is told the size the model batches by now (a number, or "auto"/"auto:N" with
    # what it detects in config.batch_sizes), as the CLI's results file says it.
    kwargs.setdefault("batch_size", _batch_size_as_given(lm))
    if kwargs.get("gen_kwargs") is None:
        kwargs["gen_kwargs"] = {}  # what lm-eval's CLI passes (and records) without any
    printed = io.StringIO()
    # lm-eval prints a line per metric it bootstraps a standard error for ("bootstrapping
    # for stddev: perplexity", 18 lines a verify): into the log (--verbose), not the run's
    # output.
    with at_scale(lm, scale), lm.knocking_out(knocked_out), \
            contextlib.redirect_stdout(printed), _without_gits_complaint():
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks),
                                          task_manager=task_manager, limit=limit,
                                          log_samples=log_samples, evaluation_tracker=tracker,
                                          **kwargs)
        done, used_scale = format_heads(lm.knocked_out), lm.scale  # whole layers expanded
    for line in printed.getvalue().splitlines():
        log.info("lm-eval: %s", line)
    args = knockout_model_args(model_args, done, used_scale)
    if done:
        args.update(live)
        if "ablation_data" in live:  # as get_model_info says it for these arguments
            results["config"]["ablation_data"] = live["ablation_data"]
    else:  # the plain model's: no means or donors were used
        for key in ("neuron_means_file", "resample_seed"):
            results["config"].pop(key, None)
        results["config"].update(ablation="zero", scale=0.0, ablation_data=None,
                                 means_file=None, reference_digest=None)
    results["config"].update(model=MODEL_NAME, model_args=args)
    # simple_evaluate told the tracker of a "CUSTOM" model without arguments (it was
    # given a loaded one): tell it what the CLI would have, and the knockout's name.
    general = tracker.general_config_tracker
    general.log_experiment_args(model_source=MODEL_NAME, model_args=args,
                                system_instruction=general.system_instruction,
                                chat_template=general.chat_template,
                                fewshot_as_multiturn=general.fewshot_as_multiturn)
    general.model_name = knockout_model_name(args, done, used_scale)
    general.model_name_sanitized = sanitize_model_name(general.model_name)
    fields = dataclasses.asdict(general)
    fields.pop("total_evaluation_time_seconds")  # the save's to say
    results.update(fields)
    return results
