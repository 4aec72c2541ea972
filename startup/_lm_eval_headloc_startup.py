"""Start-up hook of lm-eval-headloc, imported by ``lm_eval_headloc_startup.pth``.

It lets the stock ``lm_eval --model hf-headablate`` work without the user importing
anything. It must cost nothing for unrelated programs: it imports no third-party
module; it only waits for ``lm_eval.models`` to be imported and then registers the
lazy ``hf-headablate`` placeholder (see ``lm_eval_headloc.registration``, which also
loads this module for ``import lm_eval_headloc`` where the ``.pth`` file did not).
"""

import sys
from importlib.abc import Loader, MetaPathFinder

_WATCHED = "lm_eval.models"


class _RegisterAfterExec(Loader):
    """Runs the real loader, then registers hf-headablate."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            from lm_eval_headloc.registration import register

            register()
        except Exception as err:  # never break lm_eval itself because of the plugin
            print(f"lm-eval-headloc: could not register hf-headablate: {err}", file=sys.stderr)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


class _WatchLmEvalModels(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _WATCHED:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


def install():
    """Insert the watcher unless one is waiting already (idempotent)."""
    if not any(type(f).__name__ == "_WatchLmEvalModels" for f in sys.meta_path):
        sys.meta_path.insert(0, _WatchLmEvalModels())


install()
