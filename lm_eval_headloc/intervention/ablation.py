"""Ablation kinds: what a knocked-out head's output becomes (zero, mean or resample).

The knockout acts where it always has, on a head's slice of the attention output
projection's input (``hooks.ComponentKnockout``; an MLP neuron's is its one feature of the MLP
output projection's input, and everything below holds for neurons the same way); the kind
says what that slice is replaced by:

- ``zero`` (default): exact zeros, the product's behaviour before kinds existed.
- ``mean``: the head's mean output over a reference set of token positions (per layer, per
  head, averaged over every real token of every reference text), computed once in one
  no-grad pass of the unablated model (:func:`head_means`) and cached on disk
  (:func:`cached_head_means`), so that the head keeps its typical contribution and loses
  only what depends on the input.
- ``resample``: the head's output on another input, activation patching from a donor
  (:class:`Resampler`). Each model input (a batch row) gets one donor from the reference
  set, picked by a seeded hash of the row's tokens, so the same example gets the same
  donor in every measurement, whatever the batch; the row's own document (a reference
  whose tokens are the row's context, or a perplexity window's whole text; every document
  of a row several requests share) is passed over, so the set needs two examples at least.
  Positions are
  aligned from the start: the row's i-th real token gets the donor's i-th token's output,
  and past the donor's end its last token's (a shorter donor's final state stands in for
  the rest). Donor outputs come from the unablated model and are kept in memory.

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
import re
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lm_eval_headloc.common.errors import UserError
from lm_eval_headloc.common.files import cache_root, write_atomically
from lm_eval_headloc.common.options import ABLATIONS

__all__ = ["FLOAT32_OVERFLOW", "AblationError", "Resampler", "cached_head_means", "check_ablation",
           "check_reference_set", "check_scale", "default_cache_dir", "head_means", "head_outputs",
           "means_folder", "pick_donor", "reference_texts", "scale_overflow", "task_texts"]


class AblationError(UserError):
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


#: The least number that is inf as a float32: float32's largest (2^128 - 2^104) plus half
#: its last unit. A knockout computes ``scale * output`` (``hooks``) in the activations'
#: dtype, whose arithmetic is float32's at most for float16, bfloat16 and float32: a scale
#: this large is inf there (float16's product overflows all the same), so every nonzero
#: knocked-out output becomes inf and the measurement NaN. Only float64 holds it.
FLOAT32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103


def _dtype_name(dtype: object) -> str | None:
    """``torch.float64``, ``"float64"``, ``"torch.float64"`` -> ``"float64"`` (None: none
    said, or ``"auto"``)."""
    if dtype is None or dtype == "auto":
        return None
    name = str(dtype).removeprefix("torch.")
    return {"double": "float64", "float": "float32", "half": "float16"}.get(name, name)


def scale_overflow(scale: float, dtype: object, config: Any = None,
                   mixed_precision_dtype: object = None) -> str | None:
    """The dtype a model computes in (``dtype``, as a model argument; ``auto`` or None: its
    ``config``'s; ``mixed_precision_dtype`` where set) where ``scale`` overflows it, or None
    where it fits: a scale that is inf as a float32 (``FLOAT32_OVERFLOW``) fits float64
    arithmetic only."""
    if abs(scale) < FLOAT32_OVERFLOW:
        return None
    runs_in = _dtype_name(dtype) or _dtype_name(
        getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    mixed = _dtype_name(mixed_precision_dtype)
    if runs_in == "float64" and mixed in (None, "float64"):
        return None
    return mixed or runs_in or "float32"


def reference_texts(source: object, field: str | None = None,
                    task_manager: Any = None) -> list[str]:
    """The reference set named by ``ablation_data``: its texts, in order.

    A text file (one example per line, blank lines skipped), a JSONL file (the ``text``
    field of each object, or ``field``), or an lm-eval task or group name (each document's
    prompt, ``doc_to_text``, over the documents the task evaluates; ``_document_texts``).
    ``task_manager``: the lm-eval TaskManager to look names up in (default: the built-ins
    and this package's tasks).
    """
    if not isinstance(source, (str, os.PathLike)) or not str(source).strip():
        raise AblationError(f"ablation_data={source!r}: expected a text or JSONL file, or "
                            "an lm-eval task name")
    if field is not None and not field.strip():
        raise AblationError(f"ablation_field={field!r}: give the JSONL field that holds the "
                            "text, or leave it out for 'text'")
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
    return [line for line in _text(path).splitlines() if line.strip()]


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise AblationError(f"ablation_data={str(path)!r} is not UTF-8 text") from None
    except OSError as err:
        raise AblationError(f"ablation_data={str(path)!r} cannot be read: "
                            f"{err.strerror or err}") from None


def _jsonl_texts(path: Path, field: str | None) -> list[str]:
    name = field or "text"
    texts = []
    for number, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        from lm_eval_headloc.common.files import parse_json

        record = parse_json(line, f"ablation_data={str(path)!r} line {number}", AblationError)
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
        from lm_eval_headloc.tasks import make_task_manager

        task_manager = make_task_manager()
    if name not in set(task_manager.all_tasks):
        raise AblationError(f"ablation_data={name!r} is neither a file nor an lm-eval task "
                            "name (a text file, one example per line; a JSONL file; or a "
                            "task, e.g. ablation_data=headloc_induction; a task of your "
                            "own folder needs ablation_include_path=DIR, as lm-eval does "
                            "not pass --include_path to the model)")
    try:
        loaded = task_manager.load([name])
    except Exception as err:  # noqa: BLE001 — a task whose data cannot be had
        from lm_eval_headloc.tasks import load_failure

        raise AblationError(f"ablation_data={name!r}: {load_failure(name, err)}") from None
    return task_texts(loaded["tasks"])


def task_texts(tasks: dict[str, Any], subset: dict[str, list[int]] | None = None
               ) -> list[str]:
    """Each document's prompt (``doc_to_text``; ``_document_texts``) of lm-eval ``tasks``
    (leaf name -> task), over the documents ``subset`` names per leaf (default: every
    evaluated document)."""
    texts = []
    for leaf, task in tasks.items():
        docs = list(task.eval_docs)
        if subset is not None and leaf in subset:
            docs = [docs[i] for i in subset[leaf]]
        for doc in docs:
            texts.extend(_document_texts(task, doc))
    return texts


def _document_texts(task: Any, doc: Any) -> list[str]:
    """The text lm-eval has the model read for ``doc``, as it builds its requests: the
    prompt; a perplexity task's (loglikelihood_rolling: wikitext's prompt is empty) whole
    text, its target; a multiple-input task's (Winogrande's prompt is the gold choice's
    index) contexts, its choices."""
    if task.get_config("output_type") == "loglikelihood_rolling":
        return [str(task.doc_to_target(doc))]
    if getattr(task, "multiple_input", False):
        return [str(choice) for choice in task.doc_to_choice(doc)]
    text = task.doc_to_text(doc)
    return [text if isinstance(text, str) else str(text)]


def check_reference_set(kind: str, texts: Sequence[str]) -> None:
    """Refuse a reference set the kind cannot use (resample needs another example)."""
    if kind == "resample" and len(set(texts)) < 2:
        raise AblationError(f"ablation=resample needs at least two different reference "
                            f"examples to take donors from; the reference set has "
                            f"{len(set(texts))}")


def _padded(token_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the mask of real positions."""
    width = max(len(tokens) for tokens in token_lists)
    ids = torch.zeros(len(token_lists), width, dtype=torch.long)
    real = torch.zeros(len(token_lists), width, dtype=torch.bool)
    for row, tokens in enumerate(token_lists):
        ids[row, :len(tokens)] = torch.as_tensor(list(tokens))
        real[row, :len(tokens)] = True
    return ids, real


class _Recorded(Exception):
    """Raised by the last recording hook to end a forward pass early."""


def _recorded(model: nn.Module, modules: Sequence[nn.Module],
              token_lists: Sequence[Sequence[int]], batch_size: int
              ) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per batch of ``token_lists`` (right-padded, with an attention mask): the mask of
    real positions and every module's input (rows, width, features), no grad, in eval
    mode; the model's training flags are restored after."""
    if not token_lists or not all(len(tokens) for tokens in token_lists):
        raise AblationError("the reference set needs at least one token in every example")
    inputs: list[torch.Tensor | None] = [None] * len(modules)

    def record(index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            inputs[index] = args[0].detach()
            if all(hidden is not None for hidden in inputs):
                # Nothing past the last recorded projection is needed: stop the forward
                # there (cheaper, and no output-side hook of the caller's sees this pass).
                raise _Recorded
        return hook

    handles = [m.register_forward_pre_hook(record(i)) for i, m in enumerate(modules)]
    device = next(p.device for p in model.parameters())
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(token_lists), batch_size):
                ids, real = _padded(token_lists[start:start + batch_size])
                try:
                    model(input_ids=ids.to(device), attention_mask=real.long().to(device),
                          use_cache=False)
                except _Recorded:
                    pass
                if any(hidden is None for hidden in inputs):
                    raise RuntimeError("an attention output projection was not called")
                # (rows, positions, features): OPT's MLP sees them flattened, and a PEFT
                # prompt-tuning model's virtual tokens come before the text's.
                yield real, [hidden.reshape(len(real), -1, hidden.shape[-1])[:, -real.shape[1]:]
                             for hidden in inputs]
                inputs[:] = [None] * len(modules)  # type: ignore[arg-type]
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training


def head_means(model: nn.Module, modules: Sequence[nn.Module], heads_per_layer: int,
               token_lists: Sequence[Sequence[int]], batch_size: int = 8) -> list[torch.Tensor]:
    """Every layer's ``(units, width)`` mean of the output projection's input over all
    token positions of ``token_lists``, from one no-grad pass of ``model`` as it is:
    ``(heads, head_dim)`` on the attention's projections, ``(neurons, 1)`` on the MLP's
    (``heads_per_layer`` is then the MLP's width).

    Rows are right-padded and given an attention mask, and only real positions count, so
    the mean does not depend on how the texts are batched (beyond float rounding).
    Sums are kept in float64.
    """
    sums: list[torch.Tensor | None] = [None] * len(modules)
    positions = 0
    for real, inputs in _recorded(model, modules, token_lists, batch_size):
        for layer, hidden in enumerate(inputs):
            total = hidden[real.to(hidden.device)].double().sum(0).cpu()
            sums[layer] = total if sums[layer] is None else sums[layer] + total
        positions += int(real.sum())
    dtype = next(p.dtype for p in model.parameters())
    return [(total / positions).view(heads_per_layer, -1).to(dtype)  # type: ignore[union-attr]
            for total in sums]


def head_outputs(model: nn.Module, modules: Sequence[nn.Module],
                 token_lists: Sequence[Sequence[int]], batch_size: int = 8
                 ) -> list[list[torch.Tensor]]:
    """Per text of ``token_lists``, every layer's output-projection input at its real
    positions, ``(len(tokens), H·d)``, from a no-grad pass of ``model`` as it is."""
    outputs: list[list[torch.Tensor]] = []
    for real, inputs in _recorded(model, modules, token_lists, batch_size):
        for row in range(real.shape[0]):
            length = int(real[row].sum())
            outputs.append([hidden[row, :length].clone() for hidden in inputs])
    return outputs


def pick_donor(tokens: Sequence[int], references: Sequence[Sequence[int]], seed: int = 0,
               own: Collection[Sequence[int]] | None = None) -> int:
    """The reference example whose outputs row ``tokens`` gets under resample: a seeded
    hash of the tokens (independent of batching and order), moving on past the row's own
    documents: ``own``, the token lists of every document the row is the model input of
    (default: ``tokens`` itself). Only a reference equal to one of them is passed over: a
    reference the row merely starts with is another document (prompts can share a start)."""
    text = json.dumps([int(seed), [int(t) for t in tokens]])
    first = int(hashlib.sha256(text.encode()).hexdigest()[:16], 16) % len(references)
    mine = {tuple(int(t) for t in document) for document in (own or [tokens])}
    for step in range(len(references)):
        index = (first + step) % len(references)
        if tuple(references[index]) not in mine:
            return index
    raise AblationError("ablation=resample: every reference example is the model input's "
                        "own document, so none can be a donor; use other reference data")


class Resampler:
    """Donor outputs for resample ablation: which donor each row gets (:func:`pick_donor`),
    their outputs from the unablated model (computed once per donor and kept while under
    ``cache_bytes``), and the position alignment (the module docstring)."""

    def __init__(self, references: Sequence[Sequence[int]], seed: int = 0,
                 cache_bytes: int = 2 * 2**30) -> None:
        self.references = [list(tokens) for tokens in references]
        self.seed = int(seed)
        self.cache_bytes = cache_bytes
        self._cache: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0

    def donors(self, model: nn.Module, modules: Sequence[nn.Module],
               rows: Sequence[Sequence[int]], starts: Sequence[int], columns: int,
               own: Sequence[Collection[Sequence[int]]] | None = None
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """For rows whose real tokens are ``rows[b]``, starting at column ``starts[b]`` of
        inputs ``columns`` wide: per layer the outputs of the distinct donors chosen
        (donors, donor width, H·d), and the (rows, columns) index of the donor position
        each column gets, into those outputs' first two dimensions flattened (donor ×
        width + position). ``own``: per row its documents (``pick_donor``; default: each
        row is its own). Several masks per pass repeat a batch's rows K times; their
        donors are held once."""
        chosen = [pick_donor(tokens, self.references, self.seed,
                             None if own is None else own[row])
                  for row, tokens in enumerate(rows)]
        recorded = tuple(id(m) for m in modules)
        if recorded != getattr(self, "_recorded_modules", recorded):
            self._cache, self._cached_bytes = {}, 0  # outputs of other modules (kinds)
        self._recorded_modules = recorded
        missing = sorted(set(chosen) - set(self._cache))
        fresh = dict(zip(missing, head_outputs(model, modules,
                                               [self.references[i] for i in missing]),
                         strict=True)) if missing else {}
        for index, outputs in fresh.items():
            size = sum(t.numel() * t.element_size() for t in outputs)
            if self._cached_bytes + size <= self.cache_bytes:
                self._cache[index] = outputs
                self._cached_bytes += size
        distinct = sorted(set(chosen))
        per_donor = {i: self._cache.get(i) or fresh[i] for i in distinct}
        width = max(len(self.references[i]) for i in distinct)
        stacked = []
        for layer in range(len(modules)):
            sample = per_donor[distinct[0]][layer]
            block = sample.new_zeros(len(distinct), width, sample.shape[-1])
            for slot, donor in enumerate(distinct):
                values = per_donor[donor][layer]
                block[slot, :len(values)] = values.to(block.device)
            stacked.append(block)
        slot_of = {donor: slot for slot, donor in enumerate(distinct)}
        slots = torch.tensor([slot_of[i] for i in chosen])
        lengths = torch.tensor([len(self.references[i]) for i in chosen])
        offsets = torch.arange(columns)[None, :] - torch.as_tensor(list(starts))[:, None]
        index = torch.minimum(offsets.clamp(min=0), (lengths - 1)[:, None])
        return stacked, slots[:, None] * width + index


#: Hex digits of the cache key's digest in a cached means file's name.
_DIGEST_CHARS = 20
#: The name of every file ``cached_head_means`` writes (a run folder's ``means/`` holds
#: only these, which ``--force`` may clear).
MEANS_FILE = re.compile(rf"means-[0-9a-f]{{{_DIGEST_CHARS}}}\.pt")


def default_cache_dir() -> Path:
    """Where mean-ablation statistics are cached without ``ablation_cache=``."""
    return cache_root() / "means"


def means_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder mean ablation caches its statistics in (``ablation_cache=``, else
    ``default_cache_dir``), made where it is missing; an ``AblationError`` where it cannot
    be one (a file of that name, no permission)."""
    if cache_dir is not None and not str(cache_dir).strip():
        # '' would be the current folder, the means left wherever the command ran.
        raise AblationError(f"ablation_cache={str(cache_dir)!r}: expected a folder, e.g. "
                            "ablation_cache=means, or leave it out (the user's cache)")
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AblationError(f"ablation_cache={str(folder)!r}: cannot be a folder of cached "
                            f"means ({err.strerror or err})") from None
    return folder


def cached_head_means(key_fields: dict[str, Any], compute: Any,
                      cache_dir: str | os.PathLike | None = None
                      ) -> tuple[list[torch.Tensor], Path]:
    """``compute()``'s per-layer means, stored once under ``cache_dir`` by a digest of
    ``key_fields`` (model, data, dtype …) and read back on later calls.

    A file of that name whose stored fields differ is not ours to replace: refused.
    Written to a temporary name and renamed, so an interrupted run leaves no torn file.
    """
    folder = means_folder(cache_dir)  # before the pass over the reference set
    text = json.dumps(key_fields, sort_keys=True, default=str)
    path = folder / f"means-{hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_CHARS]}.pt"
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
    stored = {"fields": text, "means": [m.detach().cpu() for m in means]}
    write_atomically(path, lambda partial: torch.save(stored, partial))
    return means, path
