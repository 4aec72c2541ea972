"""Start-up hook of lm-eval-headloc, imported by ``lm_eval_headloc_startup.pth``.

It lets the stock ``lm_eval`` command use ``--model hf-headablate`` and find our tasks
(``headloc_induction``, ``swear``, ``rhyme``, ...) by name without the user importing
anything. It must cost nothing for unrelated programs: it imports no third-party module;
it only waits for lm-eval's model registry (``lm_eval.models``) and task manager
(``lm_eval.tasks.manager``) to be imported, and right after each tells
``lm_eval_headloc.intervention.registration`` (which registers the lazy ``hf-headablate``
placeholder, and adds our task folder to every ``TaskManager``; it also loads this module
for ``import lm_eval_headloc`` where the ``.pth`` file did not).
"""

import sys

# Plain classes, not importlib.abc's Loader and MetaPathFinder: importing importlib.abc
# (pathlib, tempfile, typing, ...) took about 25 ms of every Python start in the
# environment; the import system needs only the methods below.

#: lm-eval's modules after whose import ``registration.imported(name)`` is called.
_WATCHED = ("lm_eval.models", "lm_eval.tasks.manager")


class _RegisterAfterExec:
    """Runs the real loader, then tells ``registration`` the module is there."""

    def __init__(self, inner, name):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            from lm_eval_headloc.intervention import registration

            imported = getattr(registration, "imported", None)
            if imported is not None:
                imported(self._name)
            elif self._name == "lm_eval.models":  # a package older than this hook
                registration.register()
        except Exception as err:  # never break lm_eval itself because of the plugin
            print(f"lm-eval-headloc: could not register with lm-eval ({self._name}): {err}",
                  file=sys.stderr)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


class _WatchLmEvalModels:
    """Waits for the ``_WATCHED`` modules not yet imported. (Its name is what earlier
    versions called it, when it watched ``lm_eval.models`` alone: it is found by it.)"""

    def __init__(self):
        self._pending = {name for name in _WATCHED if name not in sys.modules}
        self._looking = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._pending or fullname in self._looking:
            return None
        self._looking.add(fullname)  # the lookup below asks this finder again
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None) if finder is not self else None
                spec = find(fullname, path, target) if find else None
                if spec is not None:
                    self._pending.discard(fullname)
                    if not self._pending and self in sys.meta_path:
                        sys.meta_path.remove(self)  # all seen: nothing left to watch
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _RegisterAfterExec(spec.loader, fullname)
                    return spec
            return None
        finally:
            self._looking.discard(fullname)


#: ``os.times().elapsed`` when site read this hook's ``.pth`` file (``started_at_site``):
#: when this program started, even where a script ``exec``'d it in a process older than
#: it; None where the hook was not loaded by the ``.pth`` file.
SITE_STARTED = None


def started_at_site():
    """Called by the ``.pth`` line: note the time (``os``, which site has imported: no
    module imported for it)."""
    global SITE_STARTED
    SITE_STARTED = sys.modules["os"].times().elapsed


def install():
    """Insert the watcher unless one is waiting already or there is nothing to wait for
    (idempotent)."""
    if any(type(f).__name__ == "_WatchLmEvalModels" for f in sys.meta_path):
        return
    watcher = _WatchLmEvalModels()
    if watcher._pending:
        sys.meta_path.insert(0, watcher)


install()
