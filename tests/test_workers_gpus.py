"""--gpus-per-worker > 1 (a model over several GPUs): the placement-group path, on CPU.

Ray schedules by declared resources, so a local Ray that declares 4 GPUs places two
2-GPU workers here without any GPU; the workers then load with ``parallelize=True`` on
the CPU. What this checks is our plumbing (one STRICT_PACK bundle of 2 GPUs per worker,
the model arg, results equal to one process), not accelerate's sharding over real GPUs.
Its own module, because it needs a Ray with other resources than test_workers.py's.
"""

from __future__ import annotations

import json

import pytest
from helpers import WORKERS_LOCATE as LOCATE
from helpers import (
    assert_names,
    assert_same_run_by_key,
    harness,
    last_error,
    needs_ray,
    tiny_args,
)

# Slow: each test starts a Ray cluster and its worker processes.
pytestmark = [pytest.mark.slow, needs_ray]


@pytest.fixture(scope="module")
def ray_with_four_gpus():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_two_gpu_workers_get_one_packed_bundle_each_and_measure_what_one_process_does(
        ray_with_four_gpus, tiny_model_dir, tmp_path):
    from ray.util import placement_group_table

    model = tiny_args(tiny_model_dir("llama"))
    one, two = tmp_path / "one", tmp_path / "two"
    assert harness("locate", *model, *LOCATE, "--out", str(one)) == 0
    assert harness("locate", *model, *LOCATE, "--workers", "2", "--gpus-per-worker", "2",
                   "--out", str(two)) == 0
    assert_same_run_by_key(two, one)
    groups = list(placement_group_table().values())
    assert len(groups) == 2
    for group in groups:
        assert group["strategy"] == "STRICT_PACK"
        assert list(group["bundles"].values()) == [{"GPU": 2.0, "CPU": 1.0}]
    workers = json.loads((two / "config.json").read_text())["workers"]
    assert len(workers) == 2 and all(w["measurements"] > 0 for w in workers)


def test_more_gpus_per_worker_than_the_cluster_has_is_refused_before_any_start(
        ray_with_four_gpus, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "too-many"
    code = harness("locate", *tiny_args(tiny_model_dir("llama")), *LOCATE, "--workers", "2",
                   "--gpus-per-worker", "3", "--out", str(out))
    assert code != 0
    assert_names(last_error(capsys), "--workers 2", "6 GPUs", "cluster has 4")
