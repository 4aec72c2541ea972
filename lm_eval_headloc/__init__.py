"""lm-eval-headloc: find the few attention heads a capability lives in, through lm-eval.

``import lm_eval_headloc`` registers the ``hf-headablate`` model with lm-eval (lazily:
torch loads only when the model is built), so
``lm_eval.simple_evaluate(model="hf-headablate", model_args="pretrained=...,ablate=L0H1")``
works from Python.
"""

from .heads import Head, HeadSpecError, format_heads, parse_heads, read_heads_file
from .registration import MODEL_NAME, register

__version__ = "0.1.0"

register()

__all__ = [
    "MODEL_NAME",
    "Head",
    "HeadSpecError",
    "__version__",
    "format_heads",
    "parse_heads",
    "read_heads_file",
]
