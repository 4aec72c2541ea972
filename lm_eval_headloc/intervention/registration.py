"""Make ``hf-headablate`` and our task folder known to lm-eval, lazily.

lm-eval 0.4.13 reads no plugin entry points (the ``lm_eval.models`` and ``lm_eval.tasks``
ones in pyproject.toml are for an lm-eval that will), so the package installs a start-up
hook (``_lm_eval_headloc_startup.py`` via a ``.pth`` file) that calls ``imported`` right
after ``lm_eval.models`` and ``lm_eval.tasks.manager`` are imported: the first gets
``register`` (the model), the second ``register_tasks`` (every ``TaskManager`` then
indexes our ``task_configs`` next to lm-eval's built-ins, so ``lm_eval --tasks
headloc_induction`` needs no ``--include_path``). ``import lm_eval_headloc`` does the same
through ``register_when_imported``, which loads that hook where Python did not (a checkout
used without installing). Neither imports lm-eval: a program that never uses lm-eval does
not pay for it. Only a "module:Class" placeholder is registered: torch and transformers
load when the model is first asked for.

``register_tasks`` replaces ``TaskManager.__init__``, a private surface of lm-eval (no
public setting adds a folder to the stock command's managers):
``tests/test_patched_internals.py`` checks what it relies on.

``register`` also gives the stock ``lm_eval`` command one line, not a traceback, for a
mistake in our model's arguments (a bad head list, ablation kind or reference set); only
in that program, and only for our own ``UserError``s: any other exception, ours or not,
keeps its traceback.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

MODEL_NAME = "hf-headablate"
MODEL_TARGET = "lm_eval_headloc.intervention.model:HFHeadAblateLM"
_WATCHED = "lm_eval.models"
_TASK_MANAGER = "lm_eval.tasks.manager"

log = logging.getLogger(__name__)


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
    if _running_lm_eval_cli():
        _install_cli_excepthook()


def register_tasks() -> None:
    """Make every lm-eval ``TaskManager`` that includes the built-in tasks include ours
    too, right after them (idempotent).

    Indexed after the built-ins and before the manager's ``include_path``: a folder of the
    user's wins a name clash with ours, as it does with a built-in (lm-eval's index lets a
    later folder override an earlier one, and says so). A manager made without the
    built-ins (``include_defaults=False``) gets only what it asks for; one whose
    ``include_path`` names our folder already gets it once. Its ``include_path`` attribute
    stays what it was given.
    """
    import inspect

    from lm_eval.tasks import manager

    cls = manager.TaskManager
    original = cls.__init__
    if getattr(original, "_headloc_tasks", False):
        return
    signature = inspect.signature(original)
    if not {"include_path", "include_defaults"} <= set(signature.parameters):
        _say_tasks_not_added()
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments["include_path"]
        if bound.arguments["include_defaults"]:
            try:
                from lm_eval_headloc.tasks import with_own_tasks

                bound.arguments["include_path"] = with_own_tasks(given)
            except Exception as err:  # noqa: BLE001 — never break lm-eval for our tasks
                log.warning("lm-eval-headloc: its tasks are not added: %s", err)
        original(*bound.args, **bound.kwargs)
        self.include_path = given

    __init__._headloc_tasks = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


@functools.cache
def _say_tasks_not_added() -> None:
    """Once a process: an lm-eval unlike the one ``register_tasks`` was checked on is said,
    rather than our task names left unknown without a word (our own commands pass the
    folder themselves)."""
    log.warning("lm-eval-headloc: this lm-eval's TaskManager takes no include_path or "
                "include_defaults: its tasks are not added to lm-eval's own")


#: What ``imported`` does after each lm-eval module the start-up hook watches (its
#: ``_WATCHED`` names the same modules: it runs at every Python start, so it cannot
#: import this package to read them).
_AFTER_IMPORT = {_WATCHED: register, _TASK_MANAGER: register_tasks}


def imported(name: str) -> None:
    """The start-up hook's call right after lm-eval's module ``name`` is imported."""
    after = _AFTER_IMPORT.get(name)
    if after is not None:
        after()


def register_when_imported() -> None:
    """``register`` and ``register_tasks`` now for what lm-eval has loaded already, and
    right after the import for what it has not."""
    for name, after in _AFTER_IMPORT.items():
        if name in sys.modules:
            after()
    if not all(name in sys.modules for name in _AFTER_IMPORT):
        _load_startup_hook()


def _load_startup_hook() -> None:
    """Install the start-up hook's import watcher: the one copy of it. Installed, the hook
    sits at the root of site-packages; in a source checkout it is in ``startup/``."""
    module = sys.modules.get("_lm_eval_headloc_startup")
    if module is None:
        try:
            import _lm_eval_headloc_startup as module
        except ImportError:  # used from a checkout without installing
            # lm_eval_headloc/intervention/registration.py -> the checkout's startup/
            path = (Path(__file__).resolve().parents[2] / "startup"
                    / "_lm_eval_headloc_startup.py")
            spec = importlib.util.spec_from_file_location("_lm_eval_headloc_startup", path)
            if spec is None or spec.loader is None or not path.is_file():
                # nothing to watch with; lm_eval_headloc.intervention.registration.register()
                return  # works
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
    # Again: a watcher may have been taken out since the import. (A hook from before
    # install() existed inserted its watcher on import and has nothing to call.)
    install = getattr(module, "install", None)
    if install is not None:
        install()


# --- one line for a user's mistake under the stock `lm_eval` command ---------------------

def _running_lm_eval_cli() -> bool:
    """Whether this process is the ``lm_eval`` console script or ``python -m lm_eval``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name in ("lm_eval", "lm_eval.__main__"):
        return True
    program = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    return program in ("lm_eval", "lm-eval")


def lm_eval_cli_model_args() -> str | None:
    """In the ``lm_eval`` program, every ``--model_args`` (``-a``) value its command line
    gives, joined by commas as one ``key=value,…`` text; None in any other program.

    lm-eval 0.4.13's command line merges its model args into a dict before the model sees
    them, keeping the last of a name given twice (``ablate=L0H1,ablate=L1H2``), so a name
    given twice can only be told from the command line itself. A JSON value is left out:
    lm-eval reads it as a dict, whose names cannot repeat."""
    if not _running_lm_eval_cli():
        return None
    texts: list[str] = []
    taking = False
    for token in sys.argv[1:]:
        name, equals, value = token.partition("=")
        if token in ("--model_args", "-a"):
            taking = True
            continue
        if token.startswith("-"):
            taking = False
            if equals and name == "--model_args":
                texts.append(value)
            continue
        if taking and not token.lstrip().startswith("{"):
            texts.append(token)
    return ",".join(texts)


def _install_cli_excepthook() -> None:
    # lm-eval's CLI lets a model's constructor errors end in a traceback through its
    # internals. A UserError (a bad head list, ablation kind, reference set) is the user's
    # mistake: one line (the exit status stays 1, as for any uncaught exception).
    # Everything else, internal errors included, goes to the hook that was there before.
    previous = sys.excepthook
    if getattr(previous, "_headloc_cli_hook", False):
        return

    def one_line_user_errors(exc_type, exc, tb):
        from lm_eval_headloc.common.errors import UserError, one_line

        if isinstance(exc_type, type) and issubclass(exc_type, UserError):
            print(f"{MODEL_NAME}: error: {one_line(exc)}", file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    one_line_user_errors._headloc_cli_hook = True  # type: ignore[attr-defined]
    sys.excepthook = one_line_user_errors
