"""Regression tests of reported defects: a Ray address nothing listens at, and tasks
without gold answers given a log-likelihood signal or prior."""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import (
    TASKS,
    assert_names,
    harness,
    last_error,
    needs_ray,
    raises_naming,
    tiny_args,
)

from lm_eval_headloc.common.errors import UserError
from lm_eval_headloc.common.options import RAY_TIMEOUT
from lm_eval_headloc.distributed.workers import WorkerError, check_ray_address
from lm_eval_headloc.runs import setup as engine
from lm_eval_headloc.runs.spec import RunSpec


def free_port() -> int:
    """A port nothing listens at: bound, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- --ray-address where no cluster answers ------------------------------------------

@needs_ray
def test_a_ray_address_nothing_listens_at_is_one_line_before_the_model_loads(
        tmp_path, capsys, no_model_loading):  # noqa: F811
    # Before: the model loaded, then Ray retried for some 14 minutes and ended in a
    # traceback (ConnectionError), exit 1.
    address = f"127.0.0.1:{free_port()}"
    out = tmp_path / "run"
    started = time.monotonic()
    code = harness("locate", "--workers", "2", "--ray-address", address, "--ray-timeout", "2",
                   "--out", str(out))
    assert time.monotonic() - started < 30
    assert code == 2
    assert_names(last_error(capsys), "headloc-harness: error: ", f"--ray-address {address}",
                 "connection refused")
    assert not out.exists(), "a refused run must write nothing"


def test_a_silent_address_is_given_up_after_the_timeout(monkeypatch):
    # A host that never answers (a firewall dropping packets): the wait is bounded by
    # --ray-timeout as a whole, however long one connection attempt would hang.
    released = threading.Event()

    def hang(address, timeout=None):
        released.wait(30)
        raise TimeoutError

    monkeypatch.setattr(socket, "create_connection", hang)
    started = time.monotonic()
    try:
        with raises_naming(WorkerError, "--ray-address 10.1.2.3:6379", "--ray-timeout 0.5"):
            check_ray_address("10.1.2.3:6379", 0.5)
        assert time.monotonic() - started < 5
    finally:
        released.set()  # the abandoned attempt ends now, not 30 s into other tests


def test_an_address_where_a_server_listens_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_ray_address(f"127.0.0.1:{port}", 5)
        check_ray_address(f"ray://127.0.0.1:{port}", 5)
    check_ray_address("local", 5)  # a new local cluster: nothing to ask


@pytest.mark.parametrize("address, values", [  # besides the address given
    ("10.0.0.1", ("auto, HOST:PORT",)),  # the forms it takes
    ("10.0.0.1:notaport", ("auto, HOST:PORT",)),
    ("10.0.0.1:0", ("auto, HOST:PORT",)),
    ("ray://127.0.0.1:{port}", ("127.0.0.1:{port}", "connection refused")),  # where it asked
    ("[::1]:{port}", ("[::1]:{port}",)),
])
def test_ray_address_forms(address, values):
    port = free_port()
    address = address.format(port=port)
    with raises_naming(WorkerError, f"--ray-address {address}",
                       *(value.format(port=port) for value in values)) as error:
        check_ray_address(address, 2)
    assert "\n" not in str(error.value)


@needs_ray
def test_ray_address_auto_without_a_cluster_is_one_line(monkeypatch):
    import ray._private.services as services

    def none_found(address, temp_dir=None):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(services, "canonicalize_bootstrap_address", none_found)
    with raises_naming(WorkerError, "--ray-address auto"):
        check_ray_address("auto", 2)


def test_ray_timeout_is_a_checked_runtime_option():
    assert RunSpec().ray_timeout == RAY_TIMEOUT == 60
    # How long to wait for a cluster changes no measurement: a run resumes with another.
    assert "ray_timeout" not in RunSpec().identity("locate")
    assert "ray_timeout" not in RunSpec().identity("verify")
    # Past a day, or infinite: a thread's wait cannot hold it (1e308 was a traceback).
    for bad in (0, -1, float("nan"), float("inf"), 86401, 1e308):
        with pytest.raises(UserError, match="--ray-timeout"):
            RunSpec(ray_timeout=bad).validate()


# --- tasks without gold answers (swear: doc_to_target "") ------------------------------

def _doc_task(targets, output_type="generate_until"):
    """A stand-in for an lm-eval task: its documents' gold answers are ``targets``."""
    def doc_to_target(doc):
        if isinstance(doc, Exception):
            raise doc
        return doc

    config = {"task": "fake", "output_type": output_type}
    return SimpleNamespace(get_config=config.get, eval_docs=list(targets),
                           doc_to_target=doc_to_target)


@pytest.mark.parametrize("targets, has_gold", [
    (["", "", ""], False),
    ([" ", "\n"], False),
    ([[], ["", " "]], False),
    ([None], False),
    ([], False),
    (["", " yes"], True),  # one gold answer among the documents looked at
    ([0, 1], True),  # multiple choice: index 0 is the first choice, a gold answer
    ([["a", "b"]], True),
])
def test_no_gold_reason_reads_the_documents_gold_answers(targets, has_gold):
    from lm_eval_headloc.measurement.signals import has_gold_answers, no_gold_reason

    task = _doc_task(targets)
    assert has_gold_answers(task) is has_gold
    assert (no_gold_reason(task, "leaf") is None) is has_gold


def test_no_gold_reason_says_why():
    from lm_eval_headloc.measurement.signals import GOLD_SAMPLE, no_gold_reason

    assert no_gold_reason(_doc_task([""] * 9), "swear") == (
        f"task 'swear' has no gold answer (doc_to_target is empty for its first "
        f"{GOLD_SAMPLE} documents), so it has no log-likelihood signal")
    assert no_gold_reason(_doc_task(["x"], "loglikelihood_rolling"), "r").startswith(
        "task 'r' is loglikelihood_rolling; ")
    assert no_gold_reason(_doc_task([KeyError("answer")]), "k") == (
        "task 'k': its gold answer cannot be read (KeyError: 'answer')")


@pytest.mark.parametrize("flags, flag, instead", [
    (["--prior", "atp"], "--prior atp", "--prior auto or none"),
    (["--prior", "atp-path"], "--prior atp-path", "--prior auto or none"),
    (["--signal", "logprob", "--prior", "none"], "--signal logprob", "--signal metric"),
    (["--components", "neurons"], "--components neurons", "--components heads"),
])
def test_a_log_likelihood_of_no_gold_answer_is_refused_before_weights_load(
        tiny_model_dir, tmp_path, capsys, no_model_loading, flags, flag, instead):  # noqa: F811
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "swear", *flags,
                   "--out", str(out)) == 2
    assert_names(last_error(capsys), "headloc-harness: error: ", flag, "'swear'", instead)
    assert not out.exists()


def test_prior_auto_is_none_for_a_task_without_gold_answers(tiny_model_dir):
    from helpers import load_lm

    from lm_eval_headloc.measurement.measure import HarnessMeasurement
    from lm_eval_headloc.measurement.signals import no_logprob_reason

    model_args = f"pretrained={tiny_model_dir('llama')},dtype=float32"
    lm = load_lm(tiny_model_dir("llama"))
    for tasks, attributable in ((("swear",), False), (("tiny_copy",), True),
                                (("tiny_copy", "swear"), False)):
        setup = engine.prepare(RunSpec(model_args=model_args, tasks=tasks,
                                       include_path=(TASKS,)))
        measure = HarnessMeasurement(lm, setup.tasks, setup.loaded, num_samples=2)
        assert measure.attributable is attributable, tasks
        leaves = {leaf: task for name in setup.task_names
                  for leaf, task in setup.loaded[name]["tasks"].items()}
        reason = no_logprob_reason(leaves)
        assert (reason is None) is attributable
        if reason is not None:
            assert reason.startswith("task 'swear' has no gold answer")


def test_locate_on_swear_with_prior_auto_uses_no_prior(tiny_model_dir, tmp_path):
    # Before: an attribution prior of the empty answer (every effect noise) was computed,
    # recorded as prior_used, and eased the Lasso.
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "swear",
                   "--masks", "3", "--sparsity", "0.25", "--num-samples", "2",
                   "--confirm", "0", "--bootstrap", "5", "--top-k", "2",
                   "--out", str(out)) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["prior_used"] is False and config["prior_method"] is None
    assert not (out / "prior.json").exists()


def test_workers_ended_after_ray_shut_down_start_no_new_ray():
    """At the interpreter's exit Ray's own exit handler may run before the workers' end
    (``weakref.finalize``): ray.kill then started a new local Ray to kill actors already
    gone, some 20 s after the run's last line (and a Ctrl-C'd run died in a segfault, exit
    139, not 130)."""
    from lm_eval_headloc.distributed.workers import DistributedMeasurement

    killed = []
    ray = SimpleNamespace(is_initialized=lambda: False, kill=killed.append)
    measurement = DistributedMeasurement(None, ["actor"], [{"pid": 1}], ray)
    measurement.close()
    assert killed == []
