"""benchmarks/bench_generation.py on a toy shape: what a GPU machine runs (bench_gpu.sh gen8b),
its whole default locate included."""

from __future__ import annotations

import re

import pytest

from headloc_bench import bench_generation as bench
from headloc_bench.bench_shapes import SHAPES
from lm_eval_headloc.measurement.sizing import CPU_GENERATION_ROWS


def test_the_generation_benchmark_writes_its_section(tmp_path):
    out = tmp_path / "BENCH.md"
    assert bench.main(["--config", "tiny-llama", "--device", "cpu", "--num-samples", "3",
                       "--max-gen-toks", "3", "--ks", "2", "--bare", "1,2", "--step-profile",
                       "2", "--locate", "--locate-timeout", "300",
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
    assert f"The automatic K = {auto}" in text
    # The automatic K's call taken apart for its first 2 steps of 3: four ways, each 2 tokens
    # a row (the random model never stops early), the knockout applied, the stops only looking.
    ways = re.findall(r"^\| (bare|knockout|row stops|ours) \| (\d+) \| ([\d.]+) \| "
                      r"([\d.]+) \| ([\d.]+) \|", text, flags=re.MULTILINE)
    assert [(way, steps) for way, steps, *_ in ways] == [
        ("bare", "2"), ("knockout", "2"), ("row stops", "2"), ("ours", "2")]
    # The memory each way held: a GPU's, none on a CPU.
    assert all(line.endswith("| — |") for line in text.splitlines()
               if re.match(r"\| (bare|knockout|row stops|ours) \|", line))
    for _, _, seconds, prompts, per_step in ways:  # seconds to 3 places, ms a step to 2
        # The prompts' pass, then the one step after the first token: within the call.
        assert 0 < float(prompts) <= float(seconds)
        assert 0 < float(prompts) + float(per_step) / 1000 <= float(seconds) + 0.002
    assert re.search(rf"changed the tokens of ([1-9]\d*) of the call's {3 * auto} rows", text)
    assert "the row stops' tokens are the knockout's up to each row's end: yes" in text
    # The default locate a GPU stage ends with, in a process of its own: on a model this
    # small, the baseline, the 2 masks the fit takes and every head measured alone
    # (budget.measures_all_alone: nothing left for group tests, certified).
    shape = SHAPES["tiny-llama"]
    heads = shape["num_hidden_layers"] * shape["num_attention_heads"]
    assert heads <= 108
    locate = text[text.index("### A whole default `locate`"):]
    assert "it failed" not in locate and "--tasks scale_gen" in locate
    (wall, measurements), = re.findall(r"^\| ([\d.]+) s \([\d.]+ min\) \| (\d+) \|", locate,
                                       flags=re.MULTILINE)
    assert int(measurements) == 1 + 2 + heads and float(wall) > 0
    assert "Its phases, as the run recorded them" in locate


def test_a_capped_locate_passes_its_cap_and_says_it(tmp_path, monkeypatch):
    # A certified default run of a random-weight model's hundreds of heads outlasts a GPU
    # stage: the stages cap it at the run before its group tests, and the section says so.
    import subprocess

    seen = []

    def started(argv, **_):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", started)
    run = bench.run_locate("pretrained=m", "scale_gen", None, 0, tmp_path / "locate", 60.0,
                           max_measurements=54)
    argv = seen[0]
    assert argv[argv.index("--max-measurements") + 1] == "54"
    assert argv[-2:] == ["--out", str(tmp_path / "locate")]
    assert "--max-measurements 54" in run.command
    bench.run_locate("pretrained=m", "scale_gen", None, 0, tmp_path / "locate", 60.0)
    assert "--max-measurements" not in seen[1]
    args = bench.parse_args(["--config", "tiny-llama", "--locate",
                             "--locate-max-measurements", "54", "--out", str(tmp_path / "B.md")])
    report = bench.Report("tiny-llama", "scale_gen", 3, locate=run)
    assert "### A whole default `locate` with `--max-measurements 54`" in bench.render(
        report, args, "python benchmarks/bench_generation.py", 1.0)


@pytest.mark.parametrize("argv", [["--locate-max-measurements", "54"],
                                  ["--locate", "--locate-max-measurements", "0"],
                                  ["--locate", "--locate-max-measurements", "nan"],
                                  ["--locate", "--locate-max-measurements",
                                   "99999999999999999999"]])
def test_a_bad_locate_cap_is_one_line_before_any_model(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.parse_args(["--config", "tiny-llama", *argv, "--out", str(tmp_path / "B.md")])
    assert stopped.value.code == 2
    assert "--locate-max-measurements" in capsys.readouterr().err.splitlines()[-1]


def test_the_step_clock_notes_each_step_and_puts_generate_back(tmp_path):
    # A step's time is told apart from the prompts' pass: one end a generated token, in
    # order, within the call; and the model's generate is its class's own again after.
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from headloc_bench.bench_shapes import build_random_model

    folder, _, _ = build_random_model("tiny-llama", tmp_path / "m", "float32")
    model = AutoModelForCausalLM.from_pretrained(folder)
    clock = bench.StepClock("cpu")
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    start = time.perf_counter()
    with bench.clocked(model, clock):
        out = model.generate(input_ids=ids, max_new_tokens=5, min_new_tokens=5,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (2, 3 + 5)
    assert len(clock.ends) == 5 and clock.ends == sorted(clock.ends)
    assert start < clock.ends[0] and clock.ends[-1] < time.perf_counter()
    assert "generate" not in vars(model)
    row = bench.StepRow("bare", 5, clock.ends[-1] - start,
                        step_ends=[end - start for end in clock.ends])
    assert row.prompt_seconds == clock.ends[0] - start
    assert row.per_step == pytest.approx((clock.ends[-1] - clock.ends[0]) / 4)
