"""The model a run names, read before its weights load: its args completed, its config,
its geometry, its context length, and what identifies a local model's files."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.checks import UsageError, check_load_args, check_number
from lm_eval_headloc.common.errors import one_line
from lm_eval_headloc.intervention.arg_string import ModelArgs
from lm_eval_headloc.intervention.components import (
    ComponentSpecError,
    check_component_names,
    check_top,
    ranked_task,
    ranking_top_k,
    read_heads_file,
    recorded_harmless,
)
from lm_eval_headloc.intervention.embedded import (
    local_pretrained,
    recorded_model_args,
    smollm2_model_args,
)
from lm_eval_headloc.intervention.geometry import Geometry, UnsupportedGeometry

__all__ = ["PLACEMENT_MODEL_ARGS", "check_chat_template", "check_device", "config_geometry",
           "context_length", "model_config", "model_fingerprint", "model_identity",
           "requested_components", "resolve_model_args", "same_model"]

log = logging.getLogger("lm_eval.models.hf_headablate")  # the model's, as in intervention.model


def resolve_model_args(model_args: str | None) -> str:
    """None -> the embedded SmolLM2; a device is chosen when none is given."""
    if not model_args:
        return smollm2_model_args()
    keys = ModelArgs.parse(model_args).names
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
    from transformers import AutoConfig

    from lm_eval_headloc.intervention.gguf_reads import cached_gguf_reads

    args = ModelArgs.parse(model_args).args
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

    args = ModelArgs.parse(model_args).args
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

    given = ModelArgs.parse(model_args).get("max_length")
    if given is not None:
        return check_number(given, "max_length", whole=True, min_val=1)
    return resolve_max_length(config, None, default=0) or None


def check_chat_template(model_args: str) -> None:
    """``--apply-chat-template`` needs a tokenizer with a chat template (a base model's
    has none): read from the tokenizer alone, before any weights load (transformers would
    say so only when the first prompt is built)."""
    from transformers import AutoTokenizer

    from lm_eval_headloc.intervention.gguf_reads import cached_gguf_reads

    args = ModelArgs.parse(model_args).args
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


#: Model args that say where and how fast a model runs, not which model it is.
PLACEMENT_MODEL_ARGS = frozenset({"device", "device_map", "parallelize", "max_memory_per_gpu",
                                  "max_cpu_memory", "offload_folder", "batch_size",
                                  "max_batch_size"})


def model_identity(model_args: str | None) -> dict[str, str]:
    """What ``model_args`` say the model is: each argument but placement ones (the device
    a run chose for itself, say), in any order, values as text; runs of one model compare
    equal by it."""
    return {key: str(value) for key, value in sorted(ModelArgs.parse(model_args).args.items())
            if key not in PLACEMENT_MODEL_ARGS}


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two runs' model args name one model (``model_identity``)."""
    if not all(value is None or isinstance(value, str) for value in (a, b)):
        return a == b
    return model_identity(a) == model_identity(b)


def requested_components(ablate: object, ablate_file: object, ablate_top: object) -> list[str]:
    """The component names (heads, neurons) ``ablate=``, ``ablate_file=`` and
    ``ablate_top=`` ask for, checked for syntax (not yet against the model).

    lm-eval's model_args parser turns ``ablate=1`` into an int and ``ablate=True`` into a
    bool, hence the type checks: they give one line instead of a TypeError deep inside.
    """
    names: list[str] = []
    if ablate is not None:
        if isinstance(ablate, str):
            if not ablate.strip():
                raise ComponentSpecError(
                    "ablate= is empty; give heads like ablate=L0H29+L1H31 (or neurons like "
                    "L3N1234), or leave it out"
                )
            if any(not part.strip() for part in ablate.split("+")):
                raise ComponentSpecError(
                    f"ablate={ablate}: an empty component name (two '+' in a row, or a '+' "
                    "at an end); give heads like ablate=L0H29+L1H31")
            names.extend(ablate.split("+"))
        elif isinstance(ablate, Iterable) and not isinstance(ablate, Mapping):
            # From Python: names, Heads or (layer, head) pairs.
            given = list(ablate)
            if not given:  # the stock lm_eval command reads ablate=[] as an empty list
                raise ComponentSpecError(
                    f"ablate={ablate!r} names no heads; give heads like ablate=L0H29+L1H31 "
                    "(or neurons like L3N1234), or leave it out")
            names.extend(given)
        else:
            raise ComponentSpecError(
                f"ablate={ablate!r}: expected heads like ablate=L0H29+L1H31 "
                "(L{layer}H{head}, zero-based, joined by '+'; L3H* for a whole layer; "
                "MLP neurons as L3N1234, L3N* for a whole MLP)"
            )
    if ablate_top is not None:
        ablate_top = check_top(ablate_top)
        if ablate_file is None:
            raise ComponentSpecError(f"ablate_top={ablate_top} needs ablate_file=PATH")
    if ablate_file is not None:
        if isinstance(ablate_file, str) and not ablate_file.strip():
            raise ComponentSpecError("ablate_file= is empty; give a head file (a headloc-harness "
                                     "heads.json, a JSON list, or one head per line) or leave "
                                     "it out")
        if not isinstance(ablate_file, (str, os.PathLike)):
            raise ComponentSpecError(
                f"ablate_file={ablate_file!r}: expected the path of a head file (a "
                "headloc-harness heads.json, a JSON list, or one head per line)"
            )
        # A run's ranking lists every head; naming it means the heads the run located:
        # its own top-k, unless ablate_top says how many.
        run_top = ranking_top_k(ablate_file) if ablate_top is None else None
        from_file = read_heads_file(ablate_file, top=ablate_top or run_top)
        names.extend(from_file)
        # Which heads a ranking file came to is said: a run's heads.json is its first
        # task's, which may not be the task evaluated.
        task = ranked_task(ablate_file)
        # A top-k fills its places with heads that do no harm where fewer hurt: said, so
        # that a knockout of them is not read as the task's heads.
        recorded = recorded_harmless(ablate_file) if task else set()  # read once
        harmless = [name for name in from_file if name in recorded]
        given = names[:-len(from_file)]  # ablate='s, before the file's
        log.info("knocking out %s: %s of %s%s%s%s", "+".join(map(str, from_file)),
                 f"the top {ablate_top}" if ablate_top is not None else
                 f"the run's top-{run_top} (ablate_top=K for another count)"
                 if run_top is not None else "every entry",
                 ablate_file, f" (ranked for task {task})" if task else "",
                 f"; of them {'+'.join(harmless)} did not hurt the task in the run (its "
                 "ranking records no harm)" if harmless else "",
                 f"; and {'+'.join(map(str, given))}, from ablate=" if given else "")
    check_component_names(names)
    return names


def _ranking_json(ablate_file: object) -> dict[str, Any] | None:
    """A ranking file's JSON object, or None for a list or a text file of names."""
    import json

    try:
        data = json.loads(Path(os.fspath(ablate_file)).read_text())
    except (OSError, TypeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def check_ranked_geometry(ablate_file: object, heads_per_layer: int | None) -> None:
    """Refuse a run's ranking file made on a model with another number of heads per layer
    (its ``heads_per_layer``): its names would knock out other heads here, silently, as
    long as they fall inside this model."""
    ranked = (_ranking_json(ablate_file) or {}).get("heads_per_layer")
    if isinstance(ranked, int) and heads_per_layer is not None and ranked != heads_per_layer:
        raise ComponentSpecError(f"ablate_file={ablate_file}: ranked a model of {ranked} heads "
                                 f"per layer; this one has {heads_per_layer}, so its names "
                                 "would be other heads here: give a ranking of this model")


def other_knockout(ablate_file: object, ablation: str, scale: float) -> str | None:
    """Why a ranking file's components are knocked out otherwise than the run that ranked
    them did (its ``knockout``: ``--ablation``, ``--scale``), in words; None where the
    file records none or the same. A run by mean ablation was knocked out by zeroing,
    silently."""
    recorded = (_ranking_json(ablate_file) or {}).get("knockout")
    if not isinstance(recorded, dict):
        return None
    kind, ranked_scale = recorded.get("ablation"), recorded.get("scale")
    if (kind, ranked_scale) == (ablation, float(scale)) or not isinstance(kind, str):
        return None
    return (f"{ablate_file} was ranked with --ablation {kind} --scale {ranked_scale:g}; "
            f"these knock its components out by ablation={ablation},scale={float(scale):g} "
            f"(give ablation={kind},scale={ranked_scale:g} for the run's)")


def check_device(device: object) -> None:
    """A device HFLM would not run on as asked, refused before the load: a CUDA device this
    machine lacks (HFLM fails deep inside for ``cuda`` on a machine without one and quietly
    takes another device for ``cuda:7``, said only in its log), except lm-eval's own
    default, ``cuda:0``, which falls back to the CPU; ``mps`` where torch has none (it
    failed after the weights loaded); and a name outside HFLM's list (``gpu``, ``cpu:0``),
    which it quietly replaces by ``cuda`` or ``cpu``."""
    if not isinstance(device, str):
        return
    import torch

    kind = device.partition(":")[0]
    if kind == "mps":
        if device not in ("mps", "mps:0"):
            raise UsageError(f"device={device}: the Apple GPU is device=mps (or mps:0)")
        if not torch.backends.mps.is_available():
            raise UsageError(f"device={device}: this machine's torch has no MPS (Apple GPU) "
                             "device; use device=cpu")
        return
    if kind != "cuda":
        # HFLM's other names (npu:N, xpu:N, hpu:N) it checks itself.
        if device != "cpu" and kind not in ("npu", "xpu", "hpu"):
            raise UsageError(f"device={device}: lm-eval's hf model takes cpu, cuda, cuda:N "
                             "or mps (another name it replaces by cuda or cpu without a "
                             "word)")
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = device.partition(":")[2]
    if count == 0 and device != "cuda:0":
        raise UsageError(f"device={device}: this machine has no CUDA device; use device=cpu")
    if count and index.isdigit() and int(index) >= count:
        have = "cuda:0" + (f" to cuda:{count - 1}" if count > 1 else "")
        raise UsageError(f"device={device}: this machine has {count} CUDA "
                         f"device{'s' if count > 1 else ''} ({have})")
