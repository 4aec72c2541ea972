"""benchmarks/bench_generation.py on a toy shape: what a GPU machine runs (bench_gpu.sh gen8b)."""

from __future__ import annotations

import re

from headloc_bench import bench_generation as bench
from lm_eval_headloc.measurement.sizing import CPU_GENERATION_ROWS


def test_the_generation_benchmark_writes_its_section(tmp_path):
    out = tmp_path / "BENCH.md"
    assert bench.main(["--config", "tiny-llama", "--device", "cpu", "--num-samples", "3",
                       "--max-gen-toks", "3", "--ks", "2", "--bare", "1,2",
                       "--model-dir", str(tmp_path / "model"), "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "<!-- bench_generation tiny-llama: start -->" in text
    rows = re.findall(r"^\| (\d+)[^|]* \| (\d+) \| (\d+) \| ([\d.]+) \|.*\| (yes|\*\*no\*\*) \|$",
                      text, flags=re.MULTILINE)
    # K = 1, 2 and the automatic K on a CPU, as many masks as fill a call to
    # CPU_GENERATION_ROWS rows (a tiny model's memory is no bound): 3 rows per mask.
    auto = CPU_GENERATION_ROWS // 3
    assert [(k, rows_, calls) for k, rows_, calls, _, _ in rows] == [
        ("1", "3", "1"), ("2", "6", "1"), (str(auto), str(3 * auto), "1")]
    assert all(same == "yes" for *_, same in rows)
    assert f"The automatic K = {auto}" in text and "A whole default `locate`" not in text
