"""Measurements on many processes, GPUs and nodes: Ray actors, each with its own model.

Masks are independent, so the unit of work is a chunk of masks (one forward pass's worth
with ``--masks-per-pass K``). ``--workers N`` (N > 1) starts N long-lived Ray actors
(:class:`MeasurementWorker`); each loads the model once and rebuilds the tasks and the
fixed example subset from the run's spec, exactly as the driver did. Before any work a
worker reports a fingerprint of its recorded requests and its unablated scores; the
driver refuses one that differs from its own (another model, task version or subset).

Only the driver generates masks and writes the run folder: ``runs.plan.run_plan`` appends
each chunk's records by mask key as results arrive, in any order, so resume works as
before. A chunk whose worker dies is given to another worker; the run fails, with what
was measured kept on disk, only when no worker is left.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.options import RAY_TIMEOUT
from lm_eval_headloc.common.words import counted
from lm_eval_headloc.intervention.arg_string import ModelArgs
from lm_eval_headloc.intervention.components import Head, format_heads, parse_components
from lm_eval_headloc.measurement.measure import measurement_fingerprint
from lm_eval_headloc.measurement.metrics import TaskScore

__all__ = ["RAY_EXTRA", "DistributedMeasurement", "MeasurementWorker", "WorkerError",
           "check_ray_address", "check_workers", "measurement_fingerprint", "start_workers"]

log = logging.getLogger("lm_eval_headloc")

RAY_EXTRA = "pip install 'lm-eval-headloc[ray]'"
#: Environment variables of torch.distributed / accelerate launchers: a worker inheriting
#: them (a driver started by torchrun or under Slurm) would make HFLM set up a process
#: group of its own. Each worker is a single process with its own devices.
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                   "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")
#: How long workers may take to load their model and report before the run gives up:
#: a request the cluster cannot place (more GPUs than free) would otherwise wait forever.
START_SECONDS = float(os.environ.get("HEADLOC_WORKER_START_SECONDS", 3600))
#: Unablated scores of a worker and of the driver may differ by float rounding at most
#: (other thread counts or devices sum in another order): relative, then absolute.
BASELINE_TOLERANCE = (1e-4, 1e-6)

if TYPE_CHECKING:
    pass


class WorkerError(UsageError):
    """Workers that cannot be used (refused, or all gone): reported in one line."""


def check_workers(workers: int, ray_address: str | None, gpus_per_worker: float | None,
                  ray_timeout: float = RAY_TIMEOUT) -> None:
    """Refuse what cannot work, before any model loads: Ray options without workers,
    workers without Ray installed, or a ``--ray-address`` nothing answers at within
    ``ray_timeout`` seconds (:func:`check_ray_address`). A timeout other than the default
    without an address would wait on nothing: refused rather than silently unused."""
    if ray_address is None and ray_timeout != RAY_TIMEOUT:
        raise UsageError(f"--ray-timeout {ray_timeout:g}: is how long --ray-address may take "
                         "to answer; give the address too (a local Ray waits on none)")
    if workers == 1:
        for flag, value in (("--ray-address", ray_address),
                            ("--gpus-per-worker", gpus_per_worker)):
            if value is not None:
                raise UsageError(f"{flag} {value}: is for --workers N with N > 1")
        return
    if importlib.util.find_spec("ray") is None:
        raise UsageError(f"--workers {workers}: needs Ray, which is not installed; "
                         f"install it with {RAY_EXTRA}")
    if ray_address is not None:
        check_ray_address(ray_address, ray_timeout)


def check_ray_address(address: str, timeout: float = RAY_TIMEOUT) -> None:
    """Raise ``WorkerError`` naming ``address`` when no server accepts a connection there
    within ``timeout`` seconds (the whole check, name lookup included).

    ``address`` is what ``ray.init`` takes: ``HOST:PORT``, ``ray://HOST:PORT`` (Ray
    Client), ``auto`` (the cluster Ray finds on this machine or in ``RAY_ADDRESS``) or
    ``local`` (a new local cluster: nothing to check). This is a TCP connection, not a Ray
    handshake: it tells an address nothing listens at (a cluster not started, a typo in
    the host or port) from one where a server is up, and leaves the rest to Ray.
    """
    if address == "local" or ("://" in address and not address.startswith("ray://")):
        return  # a new local cluster, or a scheme of a Ray plugin: Ray's to check
    flag = f"--ray-address {address}"
    if address == "auto":
        target = _auto_address(flag)
        if target is None:
            return
    else:
        target = address.removeprefix("ray://")
    host_port = _host_and_port(target)
    if host_port is None:
        if address.startswith("ray://"):
            return  # Ray Client may have a default port for it
        raise WorkerError(f"{flag}: expected auto, HOST:PORT (as `ray start --head` "
                          "prints) or ray://HOST:PORT")
    reason = _connect_within(*host_port, timeout)
    if reason is not None:
        raise WorkerError(f"{flag}: no Ray cluster answers at {target} ({reason}); start "
                          "one there with `ray start --head`, or give the address it prints")


def _auto_address(flag: str) -> str | None:
    """``auto``'s HOST:PORT as Ray resolves it, or None when that cannot be asked."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # another Ray's internals: leave the address to ray.init
        return None
    try:
        return canonicalize_bootstrap_address("auto")
    except ConnectionError:  # Ray found no cluster to join
        raise WorkerError(f"{flag}: no running Ray cluster found on this machine or in "
                          "RAY_ADDRESS; start one with `ray start --head`, or give "
                          "HOST:PORT") from None


def _host_and_port(target: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6 address]:port`` split; None when there is no valid port."""
    if target.startswith("["):
        host, sep, port = target[1:].partition("]:")
    else:
        host, sep, port = target.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        return None
    return host, int(port)


def _connect_within(host: str, port: int, timeout: float) -> str | None:
    """Why no TCP connection to ``host:port`` was made within ``timeout`` s, or None.

    The attempt runs in a daemon thread so that the wait is bounded as a whole: a name
    lookup does not honour a socket's timeout, and a name with several addresses gets
    the timeout once per address. An attempt still running when the time is up is
    abandoned (it ends with its socket timeout, or with the process)."""
    outcome: list[str | None] = []
    waited = f"no answer within --ray-timeout {timeout:g} s"

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(None)
        except socket.gaierror as err:
            outcome.append(f"unknown host: {err.strerror or err}")
        except TimeoutError:
            outcome.append(waited)
        except OSError as err:  # refused, unreachable: said at once, not after the wait
            outcome.append((err.strerror or type(err).__name__).lower())

    thread = threading.Thread(target=attempt, name="headloc-ray-address", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else waited


def worker_spec(spec: Any) -> Any:
    """The spec a worker measures with: the driver's, as one process (the driver's Ray
    options, checked there, are none of the worker's), on its own device: the driver's
    ``device=`` (named, or chosen by the driver's machine) is dropped, so the worker
    chooses as a run does (``engine.resolve_model_args``) from what Ray lets it see —
    ``cuda`` (its first GPU) where it was given GPUs, else ``cpu``."""
    model_args = spec.model_args
    if model_args:
        model_args = ModelArgs.parse(model_args).without("device")
    return spec.replace(workers=1, ray_address=None, ray_timeout=RAY_TIMEOUT,
                        gpus_per_worker=None, model_args=model_args)


def _scores_as_values(scores: Mapping[str, TaskScore]) -> dict[str, float]:
    return {name: float(score.value) for name, score in scores.items()}


class MeasurementWorker:
    """One worker's model and measurement (made a Ray actor by :func:`start_workers`).

    Built by ``build`` (the run layer's ``runs.plan.worker_measurement``, passed in so
    this layer need not import the one above it) from the driver's resolved spec, the
    extra tasks it measures (verify's general tasks), its example count or limit and its
    reference set, so it measures exactly what the driver would.
    """

    def __init__(self, build: Callable[..., Any], spec: dict[str, Any],
                 extra_tasks: Sequence[str], num_samples: int | None, limit: int | None,
                 reference: list[str] | None, threads: int | None = None) -> None:
        for name in DISTRIBUTED_ENV:
            os.environ.pop(name, None)
        import torch

        if threads:  # several workers on one machine share its cores
            torch.set_num_threads(threads)
        self.measure = build(spec, extra_tasks=extra_tasks, num_samples=num_samples,
                             limit=limit, reference=reference)

    def describe(self) -> dict[str, Any]:
        """What the driver checks (fingerprint, unablated scores) and records (where)."""
        import platform

        return {"fingerprint": measurement_fingerprint(self.measure),
                "baseline": _scores_as_values(self.measure([])),
                "device": str(self.measure.lm.device), "host": platform.node(),
                "pid": os.getpid()}

    def measure_masks(self, masks: Sequence[str], masks_per_pass: int | None,
                      scale: float | None = None) -> list[dict[str, TaskScore]]:
        heads = [parse_components(mask) if mask else [] for mask in masks]
        per_pass = masks_per_pass or self.measure.auto_masks_per_pass()
        ((_, scores, _),) = self.measure.measure_chunks([heads], per_pass, scale=scale)
        return scores


class DistributedMeasurement:
    """The driver's measurement (``local``: prior, baseline checks, everything but the
    masks) with its masks measured on Ray actors (:meth:`measure_chunks`)."""

    def __init__(self, local: Any, actors: list[Any], described: list[dict[str, Any]],
                 ray: Any) -> None:
        self._local, self._ray = local, ray
        self._actors = list(actors)
        self._described = {id(a): d for a, d in zip(actors, described, strict=True)}
        self._measured: collections.Counter[int] = collections.Counter()
        self._seconds: dict[int, float] = collections.defaultdict(float)
        #: Called before "every worker has died" is raised (the run's record saves the
        #: workers' shares and deaths: nothing else saves it on that error's way out).
        self.on_all_dead: Callable[[], object] | None = None
        # The actors end with this object (a command's end), not with the Python session.
        weakref.finalize(self, _kill, ray, list(actors))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)

    def __call__(self, heads: Sequence[Head]) -> dict[str, TaskScore]:
        return self._local(heads)

    def measure_chunks(self, chunks: Sequence[Sequence[Sequence[Head]]],
                       masks_per_pass: int | None = None, scale: float | None = None
                       ) -> Iterator[tuple[int, list[dict[str, TaskScore]], float]]:
        """Yield ``(index, scores, seconds per mask)`` of each chunk as it completes (its
        heads knocked out at ``scale``; None: the model's own), every worker kept busy; a
        chunk whose worker dies is given to another."""
        ray = self._ray
        from ray.exceptions import RayActorError

        pending = collections.deque(enumerate(chunks))
        idle = list(self._actors)
        running: dict[Any, tuple[Any, int, float]] = {}
        while pending or running:
            while pending and idle:
                actor = idle.pop(0)
                index, chunk = pending.popleft()
                ref = actor.measure_masks.remote([format_heads(h) for h in chunk],
                                                 masks_per_pass, scale)
                running[ref] = (actor, index, time.perf_counter())
            if not running:
                if self.on_all_dead is not None:
                    self.on_all_dead()
                raise WorkerError(f"every worker has died ({counted(len(pending), 'chunk')} "
                                  "of masks left); what was measured is on disk: rerun "
                                  "without --force to resume")
            (ref,), _ = ray.wait(list(running), num_returns=1)
            actor, index, started = running.pop(ref)
            try:
                scores = ray.get(ref)
            except RayActorError as err:
                self._actors.remove(actor)
                log.warning("worker %s died (%s); its masks go to the %d left",
                            self._described[id(actor)]["pid"], str(err).splitlines()[0],
                            len(self._actors))
                pending.appendleft((index, chunks[index]))
                continue
            seconds = time.perf_counter() - started
            self._measured[id(actor)] += len(chunks[index])
            self._seconds[id(actor)] += seconds
            idle.append(actor)
            yield index, scores, seconds / max(1, len(chunks[index]))

    def workers_config(self) -> list[dict[str, Any]]:
        """Each worker's place and throughput, for config.json."""
        rows = []
        for key, described in self._described.items():
            measured, seconds = self._measured[key], self._seconds[key]
            rows.append({"host": described["host"], "pid": described["pid"],
                         "device": described["device"], "measurements": measured,
                         "per_second": round(measured / seconds, 4) if seconds else None,
                         "alive": any(id(a) == key for a in self._actors)})
        return rows

    def close(self) -> None:
        _kill(self._ray, self._actors)
        self._actors = []


def start_workers(setup: Any, local: Any, build: Callable[..., Any], *,
                  extra_tasks: Sequence[str] = (), num_samples: int | None = None,
                  limit: int | None = None, worker_spec: dict[str, Any] | None = None
                  ) -> DistributedMeasurement:
    """Start ``setup.spec.workers`` actors (a local Ray unless ``--ray-address``), each
    measuring with what ``build`` makes of the spec (a module-level function, which Ray
    sends by name), check each against the driver's measurement ``local``, and return the
    distributed measurement. ``worker_spec`` overrides the spec the workers are built from
    (tests)."""
    import ray

    spec = setup.spec
    workers = spec.workers
    gpus = spec.gpus_per_worker
    if gpus is None:
        import torch

        gpus = 1 if torch.cuda.is_available() else 0
    if not ray.is_initialized():
        if spec.ray_address:
            # Checked before the model loaded (prepare); again now, for a cluster that went
            # away while it loaded: Ray's own retries would take some 14 minutes.
            check_ray_address(spec.ray_address, spec.ray_timeout)
            ray.init(address=spec.ray_address, log_to_driver=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, workers), include_dashboard=False,
                     log_to_driver=False)
    available = ray.cluster_resources()
    for name, each in (("GPU", gpus), ("CPU", 1)):
        if workers * each > available.get(name, 0):
            raise WorkerError(f"--workers {workers} with {each:g} {name} each needs "
                              f"{workers * each:g} {name}s; the Ray cluster has "
                              f"{available.get(name, 0):g}")
    config = dict(worker_spec or spec.as_config())
    if gpus > 1:  # a model over several GPUs: one worker's GPUs on one node
        config["model_args"] += ",parallelize=True"
    threads = None if spec.ray_address or gpus else max(1, (os.cpu_count() or 1) // workers)
    actor_class = ray.remote(MeasurementWorker)
    actors = []
    for _ in range(workers):
        options: dict[str, Any] = {"num_cpus": 1, "num_gpus": gpus, "max_restarts": 0}
        if gpus > 1:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = placement_group([{"GPU": gpus, "CPU": 1}], strategy="STRICT_PACK")
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group)
        actors.append(actor_class.options(**options).remote(
            build, config, list(extra_tasks), num_samples, limit, setup.reference,
            threads))
    from ray.exceptions import GetTimeoutError

    try:
        described = ray.get([actor.describe.remote() for actor in actors],
                            timeout=START_SECONDS)
    except GetTimeoutError:
        _kill(ray, actors)
        raise WorkerError(f"the workers did not load and report within {START_SECONDS:g} s "
                          "(HEADLOC_WORKER_START_SECONDS); see `ray status` for what the "
                          "cluster could not place") from None
    own = {"fingerprint": measurement_fingerprint(local),
           "baseline": _scores_as_values(local([]))}
    for seen in described:
        if seen["fingerprint"] != own["fingerprint"]:
            _kill(ray, actors)
            raise WorkerError(f"worker {seen['pid']} on {seen['host']} records other requests "
                              "than the driver (another model, task version or example "
                              "subset); refused")
        for task, value in own["baseline"].items():
            other = seen["baseline"].get(task, math.nan)
            relative, absolute = BASELINE_TOLERANCE
            if not math.isclose(other, value, rel_tol=relative, abs_tol=absolute):
                _kill(ray, actors)
                raise WorkerError(f"worker {seen['pid']} on {seen['host']} scores {task} "
                                  f"{other!r} unablated, the driver {value!r}; refused")
    return DistributedMeasurement(local, actors, described, ray)


def _kill(ray: Any, actors: list[Any]) -> None:
    if not ray.is_initialized():
        # Ray already shut down (its exit handler ran first, at the interpreter's exit):
        # the actors went with it, and ray.kill would start a new local Ray to kill them.
        return
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 (already gone, or Ray already shut down)
            pass
