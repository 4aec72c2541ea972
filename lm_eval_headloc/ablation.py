"""Ablation kinds: what a knocked-out head's output becomes (issue 11).

The knockout acts where it always has, on a head's slice of the attention output
projection's input (``hooks.HeadKnockout``); the kind says what that slice is replaced by:

- ``zero`` (default): exact zeros, the product's behaviour before kinds existed.
- ``mean``: the head's mean output over a reference set of token positions (per layer, per
  head, averaged over every real token of every reference text), computed once in one
  no-grad pass of the unablated model (:func:`head_means`) and cached on disk
  (:func:`cached_head_means`), so that the head keeps its typical contribution and loses
  only what depends on the input.

``scale`` generalises both: a knocked-out head's slice becomes
``replacement + scale · (output − replacement)``. ``scale=0`` (default) is the
replacement itself, ``scale=1`` leaves the head as it is, and ``scale=2`` with ``zero``
doubles the head's output: the amplification of the paper's released code.

Everything a user can get wrong here is checked before any weights load: the kind, the
scale and the reference data (:func:`reference_texts` reads it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .heads import HeadSpecError

__all__ = ["ABLATIONS", "AblationError", "cached_head_means", "check_ablation",
           "check_scale", "default_cache_dir", "head_means", "reference_texts"]

#: The ablation kinds, the default first.
ABLATIONS: tuple[str, ...] = ("zero", "mean")


class AblationError(HeadSpecError):
    """A bad ablation kind, scale or reference set: a user mistake, reported in one line."""


def check_ablation(kind: object) -> str:
    """The ablation kind, checked: one of :data:`ABLATIONS`."""
    if not isinstance(kind, str) or kind not in ABLATIONS:
        raise AblationError(f"ablation={kind!r}: must be one of {', '.join(ABLATIONS)}")
    return kind


def check_scale(value: object) -> float:
    """The scale, checked: a finite number (lm-eval's model_args give int, float or str)."""
    if isinstance(value, bool):  # model_args turn scale=True into a bool, not a number
        raise AblationError(f"scale={value!r}: must be a finite number, e.g. scale=0 or 2")
    try:
        scale = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise AblationError(
            f"scale={value!r}: must be a finite number, e.g. scale=0 or 2") from None
    if not math.isfinite(scale):
        raise AblationError(f"scale={value!r}: must be a finite number, e.g. scale=0 or 2")
    return scale


def reference_texts(source: object, field: str | None = None,
                    task_manager: Any = None) -> list[str]:
    """The reference set named by ``ablation_data``: its texts, in order.

    A text file (one example per line, blank lines skipped), a JSONL file (the ``text``
    field of each object, or ``field``), or an lm-eval task or group name (each document's
    prompt, ``doc_to_text``, over the documents the task evaluates). ``task_manager``: the
    lm-eval TaskManager to look names up in (default: the built-ins and this package's
    tasks).
    """
    if not isinstance(source, (str, os.PathLike)) or not str(source).strip():
        raise AblationError(f"ablation_data={source!r}: expected a text or JSONL file, or "
                            "an lm-eval task name")
    path = Path(source)
    if path.is_file():
        texts = _jsonl_texts(path, field) if path.suffix == ".jsonl" else _lines(path, field)
    elif path.exists():
        raise AblationError(f"ablation_data={str(source)!r} is not a file")
    else:
        texts = _task_texts(str(source), field, task_manager)
    if not texts:
        raise AblationError(f"ablation_data={str(source)!r} has no examples")
    return texts


def _lines(path: Path, field: str | None) -> list[str]:
    if field is not None:
        raise AblationError(f"ablation_field={field!r} needs a JSONL file (*.jsonl), not "
                            f"{str(path)!r}")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _jsonl_texts(path: Path, field: str | None) -> list[str]:
    name = field or "text"
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise AblationError(f"ablation_data={str(path)!r} line {number}: not JSON "
                                f"({err.msg})") from None
        value = record.get(name) if isinstance(record, dict) else None
        if not isinstance(value, str):
            keys = ", ".join(sorted(record)) if isinstance(record, dict) else "none"
            raise AblationError(f"ablation_data={str(path)!r} line {number}: no text field "
                                f"{name!r} (fields: {keys}); name it with ablation_field=")
        texts.append(value)
    return texts


def _task_texts(name: str, field: str | None, task_manager: Any) -> list[str]:
    if field is not None:
        raise AblationError(f"ablation_field={field!r} needs a JSONL file, not the task "
                            f"{name!r}")
    if task_manager is None:
        from .tasks import make_task_manager

        task_manager = make_task_manager()
    if name not in set(task_manager.all_tasks):
        raise AblationError(f"ablation_data={name!r} is neither a file nor an lm-eval task "
                            "name (a text file, one example per line; a JSONL file; or a "
                            "task, e.g. ablation_data=headloc_induction)")
    texts = []
    for task in task_manager.load([name])["tasks"].values():
        for doc in task.eval_docs:
            text = task.doc_to_text(doc)
            texts.append(text if isinstance(text, str) else str(text))
    return texts


def head_means(model: nn.Module, modules: Sequence[nn.Module], heads_per_layer: int,
               token_lists: Sequence[Sequence[int]], batch_size: int = 8) -> list[torch.Tensor]:
    """Every layer's ``(heads, head_dim)`` mean of the output projection's input over all
    token positions of ``token_lists``, from one no-grad pass of ``model`` as it is.

    Rows are right-padded and given an attention mask, and only real positions count, so
    the mean does not depend on how the texts are batched (beyond float rounding).
    Sums are kept in float64.
    """
    if not token_lists or not all(len(tokens) for tokens in token_lists):
        raise AblationError("the reference set needs at least one token in every example")
    sums: list[torch.Tensor | None] = [None] * len(modules)
    keep: dict[str, torch.Tensor] = {}
    positions = 0

    def record(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            hidden = args[0][keep["real"].to(args[0].device)]  # (positions, H*d)
            total = hidden.double().sum(0).cpu()
            sums[layer] = total if sums[layer] is None else sums[layer] + total
        return hook

    handles = [m.register_forward_pre_hook(record(i)) for i, m in enumerate(modules)]
    device = next(p.device for p in model.parameters())
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(token_lists), batch_size):
                chunk = token_lists[start:start + batch_size]
                width = max(len(tokens) for tokens in chunk)
                ids = torch.zeros(len(chunk), width, dtype=torch.long)
                real = torch.zeros(len(chunk), width, dtype=torch.bool)
                for row, tokens in enumerate(chunk):
                    ids[row, :len(tokens)] = torch.as_tensor(list(tokens))
                    real[row, :len(tokens)] = True
                keep["real"] = real
                model(input_ids=ids.to(device), attention_mask=real.long().to(device),
                      use_cache=False)
                positions += int(real.sum())
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training
    dtype = next(p.dtype for p in model.parameters())
    return [(total / positions).view(heads_per_layer, -1).to(dtype) for total in sums]


def default_cache_dir() -> Path:
    """Where mean-ablation statistics are cached without ``ablation_cache=``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lm_eval_headloc" / "means"


def cached_head_means(key_fields: dict[str, Any], compute: Any,
                      cache_dir: str | os.PathLike | None = None
                      ) -> tuple[list[torch.Tensor], Path]:
    """``compute()``'s per-layer means, stored once under ``cache_dir`` by a digest of
    ``key_fields`` (model, data, dtype …) and read back on later calls.

    A file of that name whose stored fields differ is not ours to replace: refused.
    Written to a temporary name and renamed, so an interrupted run leaves no torn file.
    """
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    text = json.dumps(key_fields, sort_keys=True, default=str)
    path = folder / f"means-{hashlib.sha256(text.encode()).hexdigest()[:20]}.pt"
    if path.exists():
        try:
            stored = torch.load(path, weights_only=True)
            fields = stored["fields"]
        except Exception:  # noqa: BLE001 (any unreadable file is refused the same way)
            fields = None
        if fields != text:
            raise AblationError(f"{path} exists but is not these means (another model, data "
                                "or dtype, or not a file of ours); remove it or choose "
                                "another ablation_cache=")
        return list(stored["means"]), path
    means = compute()
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    torch.save({"fields": text, "means": [m.detach().cpu() for m in means]}, partial)
    os.replace(partial, path)
    return means, path
