"""Make ``hf-headablate`` known to lm-eval's model registry, lazily.

lm-eval 0.4.13 has no plugin discovery, so the package installs a start-up hook
(``_lm_eval_headloc_startup.py`` via a ``.pth`` file) that calls ``register`` right after
``lm_eval.models`` is imported; ``import lm_eval_headloc`` calls it too. Only a
"module:Class" placeholder is registered: torch and transformers load when the model
is first asked for, not before.
"""

from __future__ import annotations

MODEL_NAME = "hf-headablate"
MODEL_TARGET = "lm_eval_headloc.model:HFHeadAblateLM"


def register() -> None:
    """Register the lazy placeholder (idempotent).

    ``lm_eval.models`` is imported first: lm-eval's ``get_model`` fills the registry with
    its own models only while the registry is empty, so registering into an empty one
    would hide ``hf`` and the rest.
    """
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)
