"""--workers: measurements on Ray actors, on tiny models and a local Ray.

The reference for every distributed run is the same run on one process (--workers 1):
its measurements per mask key, its design and its ranking must come out equal.
"""

from __future__ import annotations

import importlib.util
import json
import signal

import pytest
from helpers import (
    TASKS,
    assert_names,
    assert_same_run_by_key,
    harness,
    last_error,
    measurement_lines,
    measurements_by_key,
    needs_ray,
    raises_naming,
    stopped_part_way,
    tiny_args,
)
from helpers import WORKERS_LOCATE as LOCATE

# Slow: each test starts a Ray cluster and its worker processes.
pytestmark = [pytest.mark.slow, needs_ray]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    # A Ray an earlier test file left connected in this test process (the package's
    # driver keeps its own for the process's life), as test_workers_gpus does.
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def one_process_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("workers") / "one"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), *LOCATE,
                   "--out", str(out)) == 0
    return out


def test_two_workers_write_what_one_process_writes(local_ray, tiny_model_dir, tmp_path,
                                                   one_process_run):
    out = tmp_path / "two"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), *LOCATE, "--workers", "2",
                   "--out", str(out)) == 0
    assert_same_run_by_key(out, one_process_run)
    workers = json.loads((out / "config.json").read_text())["workers"]
    assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
    assert sum(w["measurements"] for w in workers) > 0


def test_a_neuron_run_on_two_workers_writes_what_one_process_writes(local_ray,
                                                                     tiny_model_dir, tmp_path):
    """Neuron masks (L0N12+...) travel to the workers as names and come back the same."""
    neurons = [*LOCATE, "--components", "heads+neurons", "--candidates", "8", "--prior", "atp"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), *neurons,
                   "--out", str(one)) == 0
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), *neurons, "--workers", "2",
                   "--out", str(two)) == 0
    assert_same_run_by_key(two, one)
    assert any("N" in mask for mask, _ in measurements_by_key(two).values())


def kill_workers_after(monkeypatch, ray, results: int, count: int) -> list:
    """Once a measuring call has had ``results`` chunks back, ``ray.kill`` ``count``
    workers (once per test); the killed actors are returned, as they die."""
    from lm_eval_headloc.distributed import workers

    original = workers.DistributedMeasurement.measure_chunks
    killed: list = []

    def killing(self, chunks, masks_per_pass=None):
        for seen, result in enumerate(original(self, chunks, masks_per_pass), start=1):
            if seen == results and not killed:
                for actor in list(self._actors)[:count]:
                    ray.kill(actor)  # it may be busy with a chunk: that one is redone
                    killed.append(actor)
            yield result

    monkeypatch.setattr(workers.DistributedMeasurement, "measure_chunks", killing)
    return killed


def test_a_killed_worker_has_its_masks_measured_by_another(local_ray, tiny_model_dir,
                                                           tmp_path, one_process_run,
                                                           monkeypatch):
    killed = kill_workers_after(monkeypatch, local_ray, results=1, count=1)
    out = tmp_path / "killed"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), *LOCATE, "--workers", "2",
                   "--out", str(out)) == 0
    assert len(killed) == 1
    assert_same_run_by_key(out, one_process_run)
    alive = [w["alive"] for w in json.loads((out / "config.json").read_text())["workers"]]
    assert sorted(alive) == [False, True]


def test_every_worker_gone_is_one_line_and_keeps_the_measurements(
        local_ray, tiny_model_dir, tmp_path, monkeypatch, capsys):
    kill_workers_after(monkeypatch, local_ray, results=2, count=2)
    out = tmp_path / "gone"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), *LOCATE, "--workers", "2",
                   "--out", str(out)) != 0
    # Rerun as it was, --force included, the run would clear what it kept.
    said = last_error(capsys)
    assert "every worker has died" in said and "rerun without --force to resume" in said
    assert len(measurements_by_key(out)) >= 2
    # config.json says so: it said alive, 0 measurements each (as the workers started).
    workers = json.loads((out / "config.json").read_text())["workers"]
    assert [w["alive"] for w in workers] == [False, False]
    assert sum(w["measurements"] for w in workers) >= 2


# Each refusal names the worker (on this host: the cluster is local) and what differs: the
# requests it records, or the task it scores otherwise unablated.
@pytest.mark.parametrize("change, named", [
    ({"seed": 5}, ("requests",)),  # another example subset
    ({"model_args": "OTHER"}, ("tiny_copy_ppl", "unablated")),
])
def test_a_worker_that_measures_something_else_is_refused(local_ray, tiny_model_dir,
                                                          change, named):
    import platform

    from lm_eval_headloc.distributed.workers import WorkerError, start_workers
    from lm_eval_headloc.runs.plan import load_model, open_measurement, worker_measurement
    from lm_eval_headloc.runs.setup import prepare
    from lm_eval_headloc.runs.spec import RunSpec

    args = dict(model_args=f"pretrained={tiny_model_dir('llama')},dtype=float32",
                tasks=("tiny_copy_ppl",), include_path=(TASKS,),
                num_samples=6)
    setup = prepare(RunSpec(**args))
    local = open_measurement(setup, load_model(setup), None, num_samples=6)
    if change.get("model_args") == "OTHER":  # same tokenizer, another model
        change = {"model_args": f"pretrained={tiny_model_dir('qwen2')},dtype=float32"}
    worker_spec = {**setup.spec.replace(workers=2).as_config(), **change}
    with raises_naming(WorkerError, f"on {platform.node()}", *named):
        start_workers(setup, local, worker_measurement, num_samples=6,
                      worker_spec=worker_spec)


def test_interrupted_driver_resumes_to_the_same_run(local_ray, tiny_model_dir, tmp_path,
                                                    one_process_run):
    # One mask per chunk: records arrive one at a time, so the interrupt lands part-way
    # (a chunk of all ten masks arrives at once and the rest can finish before SIGINT).
    args = ["locate", *tiny_args(tiny_model_dir("llama")), *LOCATE, "--workers", "2",
            "--masks-per-pass", "1"]
    out = tmp_path / "interrupted"
    partial = stopped_part_way(args, out, after=4, seconds=300, stop=signal.SIGINT,
                               fresh=True)
    assert 4 <= partial < len(measurements_by_key(one_process_run)), "not interrupted part-way"
    assert harness(*args, "--out", str(out)) == 0
    assert_same_run_by_key(out, one_process_run)


def test_workers_without_ray_or_ray_options_without_workers_are_refused(
        tiny_model_dir, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    base = ["locate", *tiny_args(tiny_model_dir("llama")), "--out", str(tmp_path / "x")]
    assert harness(*base, "--workers", "2") == 2
    assert_names(last_error(capsys), "--workers 2", "pip install 'lm-eval-headloc[ray]'")
    assert harness(*base, "--ray-address", "auto") == 2
    assert_names(last_error(capsys), "--ray-address auto", "--workers N", "N > 1")
    assert not (tmp_path / "x").exists()


def test_greedy_and_verify_on_workers_equal_one_process(local_ray, tiny_model_dir, tmp_path):
    base = [*tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy_ppl",
            "--num-samples", "5"]
    for workers in ("1", "2"):
        assert harness("greedy", *base, "--workers", workers,
                       "--out", str(tmp_path / f"greedy{workers}")) == 0
        assert harness("verify", str(tmp_path / "greedy1"), "--top-k", "2", "--general",
                       "tiny_choice", "--workers", workers,
                       "--out", str(tmp_path / f"verify{workers}")) == 0
    one, two = measurements_by_key(tmp_path / "greedy1"), measurements_by_key(tmp_path / "greedy2")
    assert one.keys() == two.keys()
    for key, (mask, scores) in one.items():
        assert two[key][0] == mask
        assert two[key][1] == pytest.approx(scores, rel=1e-5, abs=1e-6)
    tables = [json.loads((tmp_path / f"verify{w}" / "verify.json").read_text())
              for w in ("1", "2")]
    for one_row, two_row in zip(tables[0]["rows"]["tiny_copy_ppl"],
                                tables[1]["rows"]["tiny_copy_ppl"], strict=True):
        assert one_row["heads"] == two_row["heads"]
        assert one_row["score"] == pytest.approx(two_row["score"], rel=1e-5, abs=1e-6)
        assert one_row["general_scores"] == pytest.approx(two_row["general_scores"],
                                                          rel=1e-5, abs=1e-6)
    # Each score's per-example values come back from the workers with it (pickled).
    examples = [{r["key"]: r["examples"] for r in measurement_lines(tmp_path / f"verify{w}")}
                for w in ("1", "2")]
    assert examples[0] == examples[1]
    assert all(list(e) == ["tiny_choice"] for e in examples[0].values())  # ppl: none


def test_more_workers_than_the_cluster_can_place_is_one_line(local_ray, tiny_model_dir,
                                                             tmp_path, capsys):
    # The module's Ray has 2 CPUs: three one-CPU workers can never all start.
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), *LOCATE, "--workers", "3",
                   "--out", str(out)) == 2
    assert_names(last_error(capsys), "--workers 3", "3 CPUs", "2")  # needed; the cluster's


def test_the_address_of_a_running_cluster_passes_the_address_check(local_ray):
    # --ray-address is checked (a TCP connection within --ray-timeout) before the model
    # loads; a live cluster's own address must pass it.
    from lm_eval_headloc.distributed.workers import check_ray_address

    check_ray_address(local_ray.get_runtime_context().gcs_address, 10)
