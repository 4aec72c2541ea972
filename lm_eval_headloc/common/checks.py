"""The one scalar check every public function and the CLI use for their numbers.

``check_number`` wraps ``sklearn.utils.check_scalar`` (type and range) with the two
things it lets through: ``True``/``False`` (bool is an int subclass) and NaN/infinity
(every comparison with NaN is False). A failure is a ``UsageError``: one line naming the
value and what is allowed, which the CLI prints without a traceback.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from lm_eval_headloc.common.errors import UserError

__all__ = ["UsageError", "as_python", "check_dtype", "check_load_args", "check_number",
           "check_pretrained_given"]


class UsageError(UserError):
    """A bad argument (reported by the CLI in one line, exit status 2)."""


def as_python(value: object) -> object:
    """A numpy scalar (a notebook's ``np.int64(100)``, ``np.arange``'s items) as Python's
    number, anything else as it is: the run's JSON files take Python's alone."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    return value


def _shown(name: str, value: object) -> str:
    # CLI flags read "--alpha nan", Python arguments "alpha=nan".
    return f"{name} {value!r}" if name.startswith("--") else f"{name}={value!r}"


def _bound(value: float) -> str:
    """A bound as written: a whole one in full (10000000, not 1e+07)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _allowed(whole: bool, min_val: float | None, max_val: float | None,
             include_boundaries: str) -> str:
    kind = "a whole number" if whole else "a finite number"
    low = include_boundaries in ("left", "both")
    high = include_boundaries in ("right", "both")
    if min_val is not None and max_val is not None:
        if not low and not high:
            return f"{kind} strictly between {_bound(min_val)} and {_bound(max_val)}"
        return (f"{kind} with {_bound(min_val)} {'<=' if low else '<'} value "
                f"{'<=' if high else '<'} {_bound(max_val)}")
    if min_val is not None:
        return f"{kind} {'>=' if low else '>'} {_bound(min_val)}"
    if max_val is not None:
        return f"{kind} {'<=' if high else '<'} {_bound(max_val)}"
    return kind


def check_number(value: object, name: str, whole: bool = False, *,
                 min_val: float | None = None, max_val: float | None = None,
                 include_boundaries: str = "both") -> int | float:
    """``value`` as an int (``whole``) or float, checked; else ``UsageError``.

    >>> check_number(0.02, "--sparsity", min_val=0, max_val=1, include_boundaries="neither")
    0.02
    """
    allowed = _allowed(whole, min_val, max_val, include_boundaries)
    if isinstance(value, (bool, np.bool_)):
        raise UsageError(f"{_shown(name, value)}: must be {allowed}, not True/False")
    from sklearn.utils import check_scalar  # here: a spec's checks need no scikit-learn

    target = numbers.Integral if whole else numbers.Real
    try:
        check_scalar(value, name, target, min_val=min_val, max_val=max_val,
                     include_boundaries=include_boundaries)
    except (TypeError, ValueError):
        raise UsageError(f"{_shown(name, value)}: must be {allowed}") from None
    if not math.isfinite(value):
        raise UsageError(f"{_shown(name, value)}: must be {allowed}")
    return int(value) if whole else float(value)


def check_batch_size(value: object, name: str) -> int | str:
    """A batch size as lm-eval takes it: a whole number >= 1, ``auto`` or ``auto:N`` (N >=
    1: recomputed N times); ``name`` is how the user gave it (``--batch-size``,
    ``batch_size``). lm-eval's own ``batch_size=-1`` ended in a bare AssertionError."""
    def refusal(value: object) -> UsageError:
        # A model argument is said as written (batch_size=-1, which lm-eval's parser makes
        # -1.0), an option as --batch-size -1.
        shown = int(value) if isinstance(value, float) and value.is_integer() else value
        said = f"{name}{shown}" if name.endswith("=") else f"{name} {shown!r}"
        return UsageError(f"{said}: must be a whole number >= 1, 'auto' or 'auto:N' (N >= 1)")

    if isinstance(value, str):
        text = value.strip()
        if text == "auto" or (text.startswith("auto:") and text[5:].isdigit()
                              and int(text[5:]) > 0):
            return text
        try:
            value = int(text)
        except ValueError:
            raise refusal(value) from None
    try:
        return check_number(value, name, whole=True, min_val=1)
    except UsageError:  # said with the words that are allowed too
        raise refusal(value) from None


def _local_path(value: object) -> bool:
    """Whether a model argument is written as a local path (absolute, ``./``, ``../``,
    ``~``), not a Hub id."""
    import os

    return isinstance(value, str) and (os.path.isabs(value)
                                       or value.startswith(("./", "../", "~")))


def check_pretrained_given(pretrained: object) -> None:
    """Refuse no ``pretrained=`` (None) or an empty one, which HFLM reports as a
    TypeError for a missing argument or a Hub error for ''."""
    if pretrained is None or (isinstance(pretrained, str) and not pretrained.strip()):
        raise UsageError(f"pretrained={'' if pretrained is None else repr(pretrained)}: give "
                         "a model, a Hub name or a local folder (pretrained=<name or folder>)")


def check_load_args(pretrained: object, dtype: object = None, peft: object = None,
                    gguf_file: object = None, tokenizer: object = None,
                    delta: object = None, subfolder: object = None) -> None:
    """What Hugging Face would report in other words (or after the weights load),
    checked before anything loads: no ``pretrained=`` (None) or an empty one; a
    ``pretrained=``, ``peft=``, ``tokenizer=`` or ``delta=`` written as a local path
    that does not exist, which HF reads as a malformed Hub id, or beginning with ``~``,
    which nothing expands; a ``pretrained=`` that is a GGUF file (HF takes its folder and
    ``gguf_file=``); a ``gguf_file=`` missing from a local ``pretrained=`` folder; a
    ``subfolder=`` missing from a local ``pretrained=`` folder; a
    ``peft=`` folder without ``adapter_config.json`` (PEFT says so only after the base
    model loads); a ``dtype=`` torch does not have, which lm-eval turns into an
    ``AttributeError``."""
    import os

    check_pretrained_given(pretrained)
    for name, value, what in (("peft", peft, "PEFT adapter"), ("gguf_file", gguf_file,
                                                                  "GGUF file")):
        if isinstance(value, str) and not value.strip():  # HF reads '' as "none": a typo
            raise UsageError(f"{name}='': give a {what} or leave it out")
    for name, value in (("pretrained", pretrained), ("peft", peft), ("tokenizer", tokenizer),
                        ("delta", delta)):
        if isinstance(value, str) and value.startswith("~"):
            # Neither the shell (not at a word's start) nor Hugging Face expands it.
            raise UsageError(f"{name}={value}: '~' is not expanded here; write the whole "
                             f"path ({os.path.expanduser(value)})")
        if _local_path(value) and not os.path.exists(value):  # type: ignore[arg-type]
            hub = ("adapter", "user/adapter") if name == "peft" else (
                "model", "meta-llama/Llama-3.2-1B")
            raise UsageError(f"{name}={value}: no such folder (a Hub {hub[0]} is named like "
                             f"{hub[1]})")
    if isinstance(pretrained, str) and pretrained.lower().endswith(".gguf") \
            and os.path.isfile(pretrained):
        folder, name = os.path.split(pretrained)
        raise UsageError(f"pretrained={pretrained}: a GGUF file is loaded by its folder and "
                         f"name: pretrained={folder or '.'},gguf_file={name}")
    if isinstance(gguf_file, str) and isinstance(pretrained, str) \
            and os.path.isdir(pretrained) and not os.path.isfile(
                os.path.join(pretrained, gguf_file)):
        present = sorted(f for f in os.listdir(pretrained) if f.lower().endswith(".gguf"))
        raise UsageError(f"gguf_file={gguf_file}: no such file in {pretrained} (GGUF files "
                         f"there: {', '.join(present) or 'none'})")
    if isinstance(subfolder, str) and subfolder and isinstance(pretrained, str) \
            and os.path.isdir(pretrained) and not os.path.isdir(os.path.join(pretrained,
                                                                          subfolder)):
        # HF would say the folder's config.json has no model_type.
        raise UsageError(f"subfolder={subfolder}: no such folder in {pretrained}")
    if isinstance(peft, str) and os.path.isdir(peft) \
            and not os.path.isfile(os.path.join(peft, "adapter_config.json")):
        raise UsageError(f"peft={peft}: no adapter_config.json in it (a PEFT adapter folder "
                         "is what save_pretrained of a PEFT model writes)")
    if dtype != "auto":
        check_dtype(dtype, "dtype")


def check_dtype(dtype: object, name: str) -> None:
    """A dtype model argument (``dtype``, ``softmax_dtype``, ``mixed_precision_dtype``)
    written as a name torch does not have, which lm-eval turns into an ``AttributeError``
    (for the last two after the weights load)."""
    if isinstance(dtype, str):
        import torch

        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            auto = "auto, " if name == "dtype" else ""
            raise UsageError(f"{name}={dtype}: not a torch dtype; use {auto}float32, float16 "
                             "or bfloat16")
