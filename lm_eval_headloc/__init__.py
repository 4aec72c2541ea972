"""lm-eval-headloc: find the few attention heads a capability lives in, through lm-eval.

``import lm_eval_headloc`` registers the ``hf-headablate`` model with lm-eval, so
``lm_eval.simple_evaluate(model="hf-headablate", model_args="pretrained=...,ablate=L0H1")``
works from Python. Lazily: lm-eval is not imported here (``lm_eval_headloc.method.designs`` and
the other lm-eval-free modules stay free of it); the model is registered when
``lm_eval.models`` is (or has been) imported, and torch loads when the model is built.
"""

from lm_eval_headloc.intervention.components import (
    Head,
    HeadSpecError,
    format_heads,
    parse_heads,
    read_heads_file,
)
from lm_eval_headloc.intervention.registration import MODEL_NAME, register_when_imported

__version__ = "0.1.0"

register_when_imported()

__all__ = [
    "MODEL_NAME",
    "Head",
    "HeadSpecError",
    "__version__",
    "format_heads",
    "parse_heads",
    "read_heads_file",
]
