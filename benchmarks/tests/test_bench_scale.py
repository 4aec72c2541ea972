"""The at-scale benchmark (``benchmarks/bench_measure.py --config``): published shapes,
random models, realistic tasks, and the default run's extrapolation, checked on a CPU so
that a mistake shows here, before the GPU benchmarks start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import BENCHMARKS, raises_naming

from headloc_bench import (
    bench_first_run,
    bench_generation,
    bench_measure,
    bench_scale,
    bench_shapes,
    bench_stop_checks,
    bench_workers,
    measuring,
)


@pytest.mark.parametrize(("name", "published"), [
    # The parameter counts on the models' Hugging Face cards (safetensors metadata).
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3.1-8b", 8_030_261_248),
])
def test_published_shapes_have_the_published_parameter_counts(name, published):
    assert bench_shapes.parameter_count(name) == published


def test_an_unknown_shape_is_refused_naming_the_known_ones():
    with raises_naming(ValueError, "--config 'llama-70b'", "llama-3.2-1b, llama-3.1-8b"):
        bench_shapes.model_config("llama-70b")


def test_the_byte_tokenizer_has_one_token_per_byte():
    tokenizer = bench_shapes.byte_tokenizer()
    text = "Question: 3 × 4?\n"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert max(ids) < bench_shapes.BYTE_TOKENS
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 256 and tokenizer.pad_token_id == 257


def test_a_random_model_generates_bytes_only_and_its_folder_is_reused_not_overwritten(
        tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _, built = bench_shapes.build_random_model("tiny-llama", tmp_path / "m",
                                                       "float32")
    assert built
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size == 512  # the output projection keeps its full width
    prompt = tokenizer(["Question: what is two and two?"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1]:]
    assert len(new) == 40  # never stopped by an end-of-text token
    assert int(new.max()) < bench_shapes.BYTE_TOKENS
    # The same settings again: reused; other settings: rebuilt in our own folder.
    assert bench_shapes.build_random_model("tiny-llama", folder, "float32")[2] is False
    assert bench_shapes.build_random_model("tiny-llama", folder, "float32", seed=1)[2]
    # A folder that is not ours is refused before anything is written.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    with raises_naming(FileExistsError, f"--model-dir {str(theirs)!r}", bench_shapes.MARKER):
        bench_shapes.build_random_model("tiny-llama", theirs, "float32")
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def test_tasks_have_the_asked_lengths_and_load_in_lm_eval(tmp_path):
    from lm_eval_headloc.tasks import make_task_manager

    means = bench_shapes.write_tasks(tmp_path, docs=20, choice_tokens=250,
                                     gen_prompt_tokens=200, gen_answer_tokens=150,
                                     max_gen_toks=64)
    rows = [json.loads(line) for line in
            (tmp_path / "scale_gen" / "scale_gen.jsonl").read_text().splitlines()]
    assert len(rows) == 20
    assert all(160 <= len(r["question"]) <= 240 for r in rows)  # ±20 % of 200 bytes
    assert all(120 <= len(r["answer"]) <= 180 for r in rows)
    assert 200 <= means["scale_gen"] <= 240  # the question plus "Question: …\nAnswer:"
    manager = make_task_manager(str(tmp_path))
    loaded = manager.load(["scale_choice", "scale_gen"])["tasks"]
    choice, gen = loaded["scale_choice"], loaded["scale_gen"]
    doc = choice.test_docs()[0]
    assert choice.doc_to_choice(doc) == ["A", "B", "C", "D"]
    assert choice.doc_to_text(doc).endswith("\nAnswer:")
    gen_doc = gen.test_docs()[0]
    assert gen.doc_to_text(gen_doc) == f"Question: {gen_doc['question']}\nAnswer:"
    assert gen.doc_to_target(gen_doc) == f" {gen_doc['answer']}"
    assert gen.config.generation_kwargs["max_gen_toks"] == 64
    assert gen.config.generation_kwargs["until"] == ["Question:"]


def test_the_default_run_is_extrapolated_from_its_measured_parts(tmp_path):
    lines = [{"key": "baseline", "seconds": 2.0}]
    lines += [{"key": f"mask-{i:04d}", "seconds": s} for i, s in enumerate([1.0, 3.0])]
    lines += [{"key": f"alone-L0H{i}", "seconds": 0.5} for i in range(4)]
    (tmp_path / "measurements.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "prior.json").write_text(json.dumps({"seconds": 7.5}))
    row = bench_scale.read_locate_row(bench_scale.LocateRow("t", "metric", 2, 4, wall=30.0),
                                      tmp_path)
    assert row.measured == pytest.approx(2.0 + 4.0 + 2.0)
    assert row.fixed == pytest.approx(22.0)
    assert (row.baseline, row.per_mask, row.per_confirm, row.prior) == (2.0, 2.0, 0.5, 7.5)
    # fixed + baseline + 12 masks × 2 s + 34 confirmations × 0.5 s
    assert row.default_seconds(12, 34) == pytest.approx(22 + 2 + 24 + 17)


def test_the_sweep_stops_doubling_at_the_first_out_of_memory_error():
    calls = []

    class Measure:
        def measure_many(self, masks, masks_per_pass):
            calls.append((len(masks), masks_per_pass))
            if masks_per_pass >= 8:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return [{} for _ in masks]

    rows = bench_scale.sweep_masks_per_pass(Measure(), [[]] * 32, "cpu", most=64, auto=3)
    assert [r.per_pass for r in rows] == [1, 2, 3, 4, 8, 16, 32, 64]
    assert [r.seconds_per_mask is None for r in rows] == [False] * 4 + [True] * 4
    assert max(k for _, k in calls) == 8  # nothing tried beyond the first failure
    assert bench_scale.best_row(rows).seconds_per_mask is not None
    with pytest.raises(RuntimeError, match="shape mismatch"):
        class Broken(Measure):
            def measure_many(self, masks, masks_per_pass):
                raise RuntimeError("shape mismatch")
        bench_scale.sweep_masks_per_pass(Broken(), [[]] * 4, "cpu", most=4, auto=1)


def test_the_sweep_measures_the_automatic_k_beyond_its_largest_doubling():
    class Measure:
        def measure_many(self, masks, masks_per_pass):
            return [{} for _ in masks]

    rows = bench_scale.sweep_masks_per_pass(Measure(), [[]] * 32, "cpu", most=4, auto=26)
    assert [r.per_pass for r in rows] == [1, 2, 4, 26]
    assert rows[-1].masks == 26 and rows[-1].seconds_per_mask is not None


@pytest.mark.slow
def test_the_whole_benchmark_writes_its_section_on_a_toy_shape(tmp_path):
    out = tmp_path / "BENCH.md"
    out.write_text("# Measurement throughput: head\n\n<!-- bench_workers: start -->\n\nkept\n\n"
                   "<!-- bench_workers: end -->\n")
    # A process of its own: the benchmark quiets lm-eval's logging and warnings globally.
    done = subprocess.run([
        sys.executable, str(BENCHMARKS / "bench_measure.py"), "--config", "tiny-llama",
        "--dtype", "float32", "--num-samples", "4", "--repeats", "1",
        "--reference-repeats", "1", "--reference-gen-docs", "2", "--max-gen-toks", "4",
        "--max-masks-per-pass", "2", "--sweep-masks", "2", "--batch-size", "2",
        "--locate", "choice", "gen:logprob", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "<!-- bench_workers: start -->\n\nkept" in text  # others' sections kept
    section = text.split("<!-- bench_measure tiny-llama: start -->")[1]
    assert "| `scale_choice` (loglikelihood) |" in section
    assert "| `scale_gen` (generation) |" in section
    # The loglikelihood task's answers timed alone, the generation task's not.
    answers = [line for line in section.splitlines() if "the answers alone" in line]
    assert len(answers) == 1 and "the limit; lm-eval's share " in answers[0]
    assert section.index(answers[0]) < section.index("- `scale_gen`: ours/limit")
    assert "ran on 2 documents and is scaled to 4" in section
    assert "| 1 | 2 |" in section and "| 2 | 4 |" in section  # K × batch size 2
    assert "| generating, all 4 documents in one batch (batch size 4) |" in section
    assert "Automatic K = 1:" in section
    assert "`--signal logprob`, one mask per pass" in section
    assert "| `scale_choice`, metric | 12 masks + 5 confirmations |" in section
    assert "note:" not in section  # the limit replays the harness's tokens exactly
    assert ("**In short**: a default `locate` (100 examples, 12 masks + 34 confirmations) "
            "on a toy Llama (tests) (float32) on the CPU takes ≈ ") in section
    assert "s on an MMLU-shaped task; ≈ " in section
    # No generating run: derived from the logprob run's fixed part and one measurement.
    assert "| `scale_gen`, metric | not run: the logprob run's fixed part" in section
    assert "on a gsm8k-shaped task generating 4 tokens (derived from one measurement)" in section


def test_bad_options_are_one_line_errors(capsys, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "weights.bin").write_text("not ours")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for parse, argv, message in (
            (bench_measure, ["--config", "llama-70b"], "invalid choice: 'llama-70b'"),
            (bench_measure, ["--locate", "mmlu"], "--locate 'mmlu': expected choice or gen"),
            (bench_measure, ["--sparsity", "1.5"], "--sparsity 1.5: must be between 0 and 1"),
            (bench_measure, ["--sparsity", "nan"], "--sparsity nan: must be between 0 and 1"),
            (bench_measure, ["--max-masks-per-pass", "100000"],
             "--max-masks-per-pass 100000: at most 1024"),
            (bench_measure, ["--sweep-masks", "0"], "--sweep-masks 0: must be >= 1"),
            (bench_measure, ["--locate-gen-masks", "1"], "--locate-gen-masks 1: must be >= 2"),
            (bench_measure, ["--max-gen-toks", "-3"], "--max-gen-toks -3: must be >= 1"),
            (bench_measure, ["--max-gen-toks", "10000000"], "--max-gen-toks 10000000: at most"),
            (bench_measure, ["--model-dir", str(theirs)], "was not made by this benchmark"),
            (bench_measure, ["--model-dir", str(a_file)], "is not a folder"),
            (bench_workers, ["--config", "tiny-llama", "--model-dir", str(theirs)],
             "was not made by this benchmark")):
        with pytest.raises(SystemExit) as info:
            parse.parse_args(argv)
        assert info.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0]  # argparse's usage, one error line
    assert [p.name for p in theirs.iterdir()] == ["weights.bin"]  # nothing written there


def test_a_run_cut_short_keeps_what_it_measured():
    """Each stage rewrites the section: a run stopped (by a time limit) keeps
    its finished stages and says which did not finish."""
    from lm_eval_headloc.intervention.components import Head

    def timing(*seconds):
        return measuring.Timing(list(seconds))

    choice = measuring.TaskResult(
        "scale_choice", "loglikelihood", 4, "1 forward(s) of 16×260 tokens", timing(3.0),
        timing(1.0), timing(0.50), timing(0.48), 0.25, 0.25)
    report = bench_scale.ScaleReport("tiny-llama", 139_584, 1.0,
                                     {"scale_choice": 258, "scale_gen": 218}, [Head(0, 1)],
                                     2, tasks=[choice])
    args = bench_measure.parse_args(["--config", "tiny-llama"])
    text = bench_scale.render_scale(report, args, "python benchmarks/bench_measure.py")
    assert ("**incomplete**: it stopped before finishing one measurement, masks per pass, "
            "generating vs logprob, locate runs") in text
    assert "| `scale_choice` (loglikelihood) |" in text and "| 1.04× |" in text
    assert "0.14 M parameters" in text
    for absent in ("Several masks", "generating vs `--signal logprob`", "default `locate`",
                   "ran on 2 documents"):
        assert absent not in text
    report.left.clear()
    assert "incomplete" not in bench_scale.render_scale(report, args, "…")


def test_a_k_that_measure_many_had_to_halve_is_the_sweeps_memory_limit():
    class Measure:  # as HarnessMeasurement: halves K for good instead of raising
        most_masks_per_pass = None

        def measure_many(self, masks, masks_per_pass):
            if masks_per_pass >= 8:
                self.most_masks_per_pass = masks_per_pass // 2
            return [{} for _ in masks]

    measure = Measure()
    rows = bench_scale.sweep_masks_per_pass(measure, [[]] * 32, "cpu", most=16, auto=4)
    assert [(r.per_pass, r.seconds_per_mask is None) for r in rows] == [
        (1, False), (2, False), (4, False), (8, True), (16, True)]
    assert measure.most_masks_per_pass is None  # the measurement is left uncapped


def test_the_derived_generating_run_is_the_logprob_runs_fixed_part_plus_its_measurements():
    logprob = bench_scale.LocateRow("scale_gen", "logprob", 12, 5, wall=30.0, measured=10.0,
                                    prior=4.0)
    derived = bench_scale.derived_generating_row(logprob, generating=2.0)
    assert (derived.task, derived.signal, derived.derived) == ("scale_gen", "metric", True)
    assert derived.fixed == pytest.approx(20.0) and derived.prior == 4.0
    # 20 s fixed + the baseline, 12 masks and 34 heads alone at 2 s each
    assert derived.default_seconds(12, 34) == pytest.approx(20 + 2 + 24 + 68)


def test_ways_are_timed_round_robin_every_other_round_backwards():
    """Ours was always timed first after the limit's work; the generating ours came out
    1.32x the limit once (n=1) while the locate's own measurements were below it."""
    calls: list[str] = []
    timings = measuring.time_interleaved(
        [lambda: calls.append("ours"), lambda: calls.append("limit")], 3, "cpu")
    assert calls == ["ours", "limit", "limit", "ours", "ours", "limit"]
    assert [len(t.seconds) for t in timings] == [3, 3]


def test_bench_gpu_stages_pass_options_their_scripts_accept():
    # A typo in bench_gpu.sh's options would show only on the GPU: parse each stage's
    # `run <stage> <script> ...` line (continuations joined) with that script's own parser,
    # the options as run() passes them (--out before the stage's own).
    import re
    import shlex

    script = (BENCHMARKS / "bench_gpu.sh").read_text().replace("\\\n", " ")
    stages = {stage: (name, options) for stage, name, options in re.findall(
        r"^\s*run (\w+) (\w+)\.py (--config .*)$", script, flags=re.MULTILINE)}
    assert sorted(stages) == ["1b", "8b", "first1b", "gen1b", "gen8b", "ratio1b", "ratio8b"]
    parsers = {"bench_measure": bench_measure.parse_args,
               "bench_generation": bench_generation.parse_args,
               "bench_first_run": lambda argv: bench_first_run.parse_args(argv)[0]}
    parsed = {}
    for stage, (name, options) in stages.items():
        parsed[stage] = args = parsers[name]([
            "--device", "cpu", "--dtype", "bfloat16", "--out", "unused.md",
            *shlex.split(options)])
        size = re.search(r"\d+b$", stage).group()
        assert args.config == {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}[size]
    for stage in ("1b", "8b", "gen1b", "gen8b"):  # each times a run (or its parts)
        assert parsed[stage].locate, stage
    # A generating locate and a first run are capped at the default run's measurements
    # before its group tests: certifying hundreds of random heads outlasts a stage.
    for stage in ("gen1b", "gen8b"):
        assert parsed[stage].locate_max_measurements == 54
    _, locate_args = bench_first_run.parse_args(shlex.split(stages["first1b"][1]))
    assert locate_args == ["--max-measurements", "54"]
    # The short pass: the automatic K and K = 1, the bare generate at the automatic K only.
    for stage in ("ratio1b", "ratio8b"):
        args = parsed[stage]
        assert args.k_values == [1] and args.bare_values == {"auto"}
        assert not args.locate
    assert parsed["ratio1b"].step_profile > 0 and parsed["gen1b"].step_profile > 0
    # The row stops' cost a step, at the rows of both sizes' calls, with the ids on the GPU.
    stops = re.search(r"^\s*\"\$python\" benchmarks/bench_stop_checks\.py (.*) --out ", script,
                      flags=re.MULTILINE)
    args = bench_stop_checks.parse_args(shlex.split(stops.group(1)))
    assert args.device == "cuda" and args.row_counts == [1500, 3700]
