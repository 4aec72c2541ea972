"""lm-eval's --num_fewshot, --gen_kwargs and --system_instruction: every measurement's
prompts and generation arguments are the ones lm-eval itself makes with them (the
reference: ``simple_evaluate`` on the same documents), the run records them, its lm-eval
results files carry them, and where they would change nothing or crash after the load they
are refused before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TASKS, assert_names, harness, last_error, raises_naming, tiny_args

from lm_eval_headloc.runs.option_values import parse_gen_kwargs
from lm_eval_headloc.runs.spec import RunSpec

TASK_LIST = "tiny_copy,tiny_generate"  # a loglikelihood task and a generation task
INSTRUCTION = "Copy the words."


def _requests(pairs) -> dict[str, list[str]]:
    """Each task's requests (prompt and continuation or generation arguments), sorted:
    lm-eval numbers a sampled document by its place in the sample, not in the task."""
    by_task: dict[str, list[str]] = {}
    for task, args in pairs:
        by_task.setdefault(task, []).append(json.dumps(list(args), sort_keys=True))
    return {task: sorted(requests) for task, requests in by_task.items()}


def _instance_args(measure) -> dict[str, list[str]]:
    return _requests((i.task_name, i.args) for i in measure.recorded_instances())


def test_prompts_and_generation_arguments_are_lm_evals_own(tiny_model_dir):
    import lm_eval

    from lm_eval_headloc.runs.plan import load_model, open_measurement
    from lm_eval_headloc.runs.setup import prepare
    from lm_eval_headloc.tasks import make_task_manager

    model = tiny_model_dir("llama")
    spec = RunSpec(model_args=f"pretrained={model},dtype=float32,device=cpu",
                   tasks=tuple(TASK_LIST.split(",")), include_path=(TASKS,), num_fewshot=2,
                   gen_kwargs="max_gen_toks=5,until=[';']", system_instruction=INSTRUCTION)
    setup = prepare(spec)
    lm = load_model(setup)
    measure = open_measurement(setup, lm, None, 6)
    ours = _instance_args(measure)
    reference = lm_eval.simple_evaluate(
        model=lm, tasks=TASK_LIST.split(","), task_manager=make_task_manager([TASKS]),
        samples=measure.subset, num_fewshot=2, gen_kwargs={"max_gen_toks": 5, "until": [";"]},
        system_instruction=INSTRUCTION,
        log_samples=True, bootstrap_iters=0)
    theirs = _requests((task, s["arguments"][0])
                       for task, samples in reference["samples"].items() for s in samples)
    assert ours == theirs and sorted(ours) == ["tiny_copy", "tiny_generate"]
    assert reference["n-shot"] == {"tiny_copy": 2, "tiny_generate": 2}
    generated = [json.loads(r)[1] for r in ours["tiny_generate"]]
    assert all(g["max_gen_toks"] == 5 and g["until"] == [";"] for g in generated)
    # Without the overrides the prompts are the tasks' own: zero-shot (one paragraph),
    # 3 new tokens.
    plain = _instance_args(open_measurement(
        prepare(spec.replace(num_fewshot=None, gen_kwargs=None, system_instruction=None)), lm,
        None, 6))
    for task, requests in plain.items():
        assert all("\n\n" not in json.loads(r)[0] for r in requests)
        prompts = [json.loads(r)[0] for r in ours[task]]
        assert all(prompt.startswith(INSTRUCTION) for prompt in prompts)
        assert all(prompt.removeprefix(INSTRUCTION).strip().count("\n\n") == 2
                   for prompt in prompts)
    assert all(json.loads(r)[1]["max_gen_toks"] == 3 for r in plain["tiny_generate"])


def test_a_run_records_them_resumes_on_the_same_and_refuses_others(tiny_model_dir, tmp_path,
                                                                      capsys):
    out = tmp_path / "greedy"
    common = [*tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_generate",
              "--num-samples", "6", "--out", str(out)]
    assert harness("greedy", *common, "--num-fewshot", "2",
                   "--gen-kwargs", "max_gen_toks=4,temperature=0") == 0
    spec = json.loads((out / "config.json").read_text())["spec"]
    assert spec["num_fewshot"] == 2
    assert json.loads(spec["gen_kwargs"]) == {"max_gen_toks": 4, "temperature": 0}
    measured = (out / "measurements.jsonl").read_text()
    # lm-eval's spelling, the JSON form and another order are the same run: nothing new.
    assert harness("greedy", *common, "--num_fewshot", "2",
                   "--gen_kwargs", '{"temperature": 0, "max_gen_toks": 4}') == 0
    assert (out / "measurements.jsonl").read_text() == measured
    capsys.readouterr()
    assert harness("greedy", *common, "--num-fewshot", "3",
                   "--gen-kwargs", "max_gen_toks=4,temperature=0") == 2
    assert "num_fewshot" in last_error(capsys)


def test_verify_writes_lm_eval_files_with_the_runs_overrides(tiny_model_dir, tmp_path):
    run, out, results_dir = tmp_path / "run", tmp_path / "verify", tmp_path / "lm-eval"
    assert harness("greedy", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_generate",
                   "--num-samples", "6", "--num-fewshot", "2", "--gen-kwargs",
                   "max_gen_toks=4", "--system_instruction", INSTRUCTION, "--out", str(run)) == 0
    assert harness("verify", str(run), "--top-k", "1", "--general", "tiny_copy",
                   "--random-draws", "0", "--out", str(out), "--output-path",
                   str(results_dir)) == 0
    measured = {json.loads(line)["key"]: json.loads(line) for line in
                (out / "measurements.jsonl").read_text().splitlines()}
    for key, path in json.loads((out / "lm_eval_files.json").read_text()).items():
        saved = json.loads(Path(path).read_text())
        assert saved["n-shot"] == {"tiny_copy": 2, "tiny_generate": 2}
        assert saved["system_instruction"] == INSTRUCTION
        assert saved["configs"]["tiny_generate"]["generation_kwargs"]["max_gen_toks"] == 4
        for task in ("tiny_copy", "tiny_generate"):
            metric = measured[key]["metrics"][task]
            assert saved["results"][task][metric] == pytest.approx(
                measured[key]["scores"][task])


@pytest.mark.parametrize("extra, values", [  # the values each refusal names
    (["--gen-kwargs", "tempreature=0"], ("--gen-kwargs tempreature",)),
    (["--gen-kwargs", "tempreature=0"], ("did you mean temperature?",)),  # the suggestion
    (["--gen-kwargs", "max_length=40"], ("--gen-kwargs max_length", "max_gen_toks")),
    (["--gen-kwargs", "max_gen_toks=0"], ("--gen-kwargs max_gen_toks=0", ">= 1")),
    # lm-eval's parser reads -1 as -1.0: the refusal shows what was written.
    (["--gen-kwargs", "temperature=0,max_gen_toks=-1"], ("--gen-kwargs max_gen_toks=-1:",)),
    (["--gen-kwargs", "max_gen_toks"], ("--gen-kwargs 'max_gen_toks'", "key=value")),
    (["--gen-kwargs", "{max_gen_toks: 3}"], ("--gen-kwargs '{max_gen_toks: 3}'", "JSON")),
    (["--gen-kwargs", "until=3"], ("--gen-kwargs until=3",)),
    (["--gen-kwargs", "max_gen_toks=3", "--tasks", "tiny_copy"],
     ("--gen-kwargs", "loglikelihood")),  # the tasks' output types
    (["--gen-kwargs", "max_gen_toks=3", "--signal", "logprob"],
     ("--gen-kwargs", "--signal logprob")),
    (["--num-fewshot", "2", "--tasks", "tiny_zero_shot"],
     ("--num-fewshot 2", "tiny_zero_shot", "0")),
    # lm-eval would fail at the first measurement, after the load: said before it.
    # tiny_generate draws its few-shot examples from the documents it asks, without the
    # question itself: 12 can give 12 (the split asked is not its few-shot split), not 13.
    (["--num-fewshot", "13"], ("--num-fewshot 13", "'tiny_generate'", "12 documents", "12")),
    (["--num-fewshot", "1000000000"], ("--num-fewshot 1000000000", "12")),
    (["--gen-kwargs", "max_gen_toks=128"], ("--gen-kwargs max_gen_toks=128", "128 tokens")),
    # A task's own length, or lm-eval's 256 where it names none, against the tiny models'
    # 128: lm-eval's HF model would assert at the first generation.
    (["--tasks", "tiny_long_generate"],
     ("'tiny_long_generate'", "256", "lm-eval's default", "128 tokens", "max_gen_toks=N")),
    (["--tasks", "tiny_long_generate", "--gen-kwargs", "until=';'"],
     ("'tiny_long_generate'", "256", "128 tokens")),
    # tiny_generate sets no temperature: lm-eval's 0.0, at which generate will not sample.
    (["--gen-kwargs", "do_sample=true"],
     ("'tiny_generate'", "do_sample=true", "temperature 0", "lm-eval's default")),
    (["--gen-kwargs", "do_sample=true,temperature=0"],
     ("do_sample=true", "temperature 0", "(--gen-kwargs)")),  # where the 0 came from
])
def test_overrides_that_change_nothing_or_would_crash_are_refused_before_the_load(
        tiny_model_dir, tmp_path, capsys, no_model_loading, extra, values):
    folder = tmp_path / "tasks"
    folder.mkdir()
    # A task whose YAML fixes zero-shot, as some of lm-eval's do.
    (folder / "zero.yaml").write_text("include: " + str(Path(TASKS) / "tiny_copy" /
                                                        "tiny_copy.yaml")
                                      + "\ntask: tiny_zero_shot\nnum_fewshot: 0\n")
    _long_generation_task(folder)
    tasks = [] if "--tasks" in extra else ["--tasks", "tiny_generate"]
    assert harness("greedy", *tiny_args(tiny_model_dir("llama")), "--include-path",
                   str(folder), *tasks, *extra, "--out", str(tmp_path / "run")) == 2
    assert_names(last_error(capsys), "headloc-harness: error: ", *values)


def _long_generation_task(folder: Path) -> None:
    """tiny_generate with no max_gen_toks: lm-eval's 256, beyond the tiny models' 128."""
    (folder / "long.yaml").write_text("include: " + str(Path(TASKS) / "tiny_generate" /
                                                        "tiny_generate.yaml")
                                      + "\ntask: tiny_long_generate\n"
                                      "generation_kwargs: {until: ['\\n'], do_sample: false}\n")


def test_a_generation_longer_than_the_model_is_said_where_it_would_run(tiny_model_dir,
                                                                       tmp_path):
    # types generates nothing (it reads the prompts): the same task is no refusal there;
    # a shorter generation is measured.
    folder = tmp_path / "tasks"
    folder.mkdir()
    _long_generation_task(folder)
    args = [*tiny_args(tiny_model_dir("llama")), "--include-path", str(folder), "--tasks",
            "tiny_long_generate", "--num-samples", "2"]
    assert harness("types", *args, "--out", str(tmp_path / "types")) == 0
    assert harness("greedy", *args, "--gen-kwargs", "max_gen_toks=4",
                   "--out", str(tmp_path / "greedy")) == 0


def test_gen_kwargs_read_as_lm_eval_reads_them():
    # The forms lm-eval's simple_evaluate and CLI take: key=value (numbers and booleans
    # become numbers and booleans) and a JSON object.
    assert parse_gen_kwargs("max_gen_toks=8,do_sample=true,temperature=0.5") == {
        "max_gen_toks": 8, "do_sample": True, "temperature": 0.5}
    assert parse_gen_kwargs('{"until": ["\\n\\n", "Q:"]}') == {"until": ["\n\n", "Q:"]}
    assert parse_gen_kwargs("until=['\\n\\n', 'Q:'],max_gen_toks=256") == {
        "until": ["\n\n", "Q:"], "max_gen_toks": 256}
    # One run, however it is written.
    assert RunSpec(gen_kwargs="temperature=0,max_gen_toks=8") == RunSpec(
        gen_kwargs={"max_gen_toks": 8, "temperature": 0})
    assert RunSpec(gen_kwargs="temperature=0,until='Q:'") == RunSpec(
        gen_kwargs='{"temperature": 0.0, "until": ["Q:"]}')
    assert RunSpec(gen_kwargs="top_k=5.0") == RunSpec(gen_kwargs="top_k=5")


def test_gen_kwargs_are_given_to_generate_in_the_types_it_takes(tiny_model_dir):
    """generate's warpers refuse an int temperature or repetition penalty and a float top_k
    (a ValueError at the first measurement, after the load): each is given as it takes it,
    checked on a real generate call."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    given = parse_gen_kwargs("do_sample=true,temperature=2,top_k=5.0,repetition_penalty=2,"
                             "top_p=1,min_p=0")
    assert given == {"do_sample": True, "temperature": 2.0, "top_k": 5,
                     "repetition_penalty": 2.0, "top_p": 1.0, "min_p": 0.0}
    prompt = torch.tensor([[1, 5, 6]])
    with pytest.raises(ValueError):  # as written, generate refuses it
        model.generate(prompt, max_new_tokens=2, pad_token_id=0, do_sample=True,
                       temperature=2)
    assert model.generate(prompt, max_new_tokens=2, pad_token_id=0, **given).shape == (1, 5)


def test_a_locate_report_says_them(tiny_model_dir, tmp_path):
    out = tmp_path / "locate"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_generate",
                   "--num-samples", "6", "--masks", "4", "--confirm", "0", "--prior", "none",
                   "--num-fewshot", "1", "--gen-kwargs", "max_gen_toks=4",
                   "--system-instruction", INSTRUCTION, "--out", str(out)) == 0
    report = (out / "report.md").read_text()
    assert "- few-shot examples per prompt: 1 (--num-fewshot" in report
    assert '- generation arguments: `{"max_gen_toks": 4}`' in report
    assert "- system instruction: 'Copy the words.' (--system-instruction)" in report
    # The tiny model's tokenizer has no chat template: said, and recorded per task.
    assert "- chat template: not used" in report
    assert json.loads((out / "config.json").read_text())["chat_template"] == {
        "tiny_generate": False}


def test_sampled_generation_draws_alike_in_every_measurement_and_in_lm_eval(tiny_model_dir,
                                                                            monkeypatch):
    """With do_sample=true each measurement of a mask used to sample anew (nothing seeded
    the generators; simple_evaluate seeds them): now every measurement draws as lm-eval's
    own evaluation of the same documents does."""
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM
    from lm_eval_headloc.runs.plan import load_model, open_measurement
    from lm_eval_headloc.runs.setup import prepare
    from lm_eval_headloc.tasks import make_task_manager

    generated: list[list[str]] = []
    generate = HFHeadAblateLM.generate_until

    def spy(self, requests, *args, **kwargs):
        out = generate(self, requests, *args, **kwargs)
        generated.append(list(out))
        return out

    monkeypatch.setattr(HFHeadAblateLM, "generate_until", spy)
    spec = RunSpec(model_args=f"pretrained={tiny_model_dir('llama')},dtype=float32,device=cpu",
                   tasks=("tiny_generate",), include_path=(TASKS,),
                   gen_kwargs="do_sample=true,temperature=1.0,max_gen_toks=6")
    setup = prepare(spec)
    measure = open_measurement(setup, load_model(setup), None, 6)
    measure([])
    measure(["L0H1"])  # another mask between: the generators move on
    measure([])
    lm_eval.simple_evaluate(model=measure.lm, tasks=["tiny_generate"],
                            task_manager=make_task_manager([TASKS]), samples=measure.subset,
                            gen_kwargs={"do_sample": True, "temperature": 1.0,
                                        "max_gen_toks": 6})
    first, knocked, again, theirs = generated[-4:]
    assert first == again == theirs
    # Sampled, not the greedy continuation (lm-eval's own greedy run: a greedy measurement
    # generates through multigen, past this spy).
    lm_eval.simple_evaluate(model=measure.lm, tasks=["tiny_generate"],
                            task_manager=make_task_manager([TASKS]), samples=measure.subset,
                            gen_kwargs={"max_gen_toks": 6})
    assert len(generated) == 5
    assert generated[-1] != first


@pytest.mark.parametrize("value, values", [  # the bad value and its allowed range
    ("temperature=nan", ("--gen-kwargs temperature=nan",)),
    ("top_k=inf", ("--gen-kwargs top_k=inf",)),
    ("do_sample=true,top_p=1.5", ("--gen-kwargs top_p=1.5", "0 and 1")),
    ("temperature=-1", ("--gen-kwargs temperature=-1.0", ">= 0")),
    ("temperature=warm", ("--gen-kwargs temperature='warm'", ">= 0")),
    ("top_k=2.5", ("--gen-kwargs top_k=2.5", ">= 0")),
    ("repetition_penalty=0", ("--gen-kwargs repetition_penalty=0", "above 0")),
    ("do_sample=yes", ("--gen-kwargs do_sample='yes'", "true or false")),
    ("", ("--gen-kwargs ''", "key=value", "JSON")),
])
def test_generation_values_generate_would_refuse_after_the_load_are_refused_now(value,
                                                                                values):
    from lm_eval_headloc.common.checks import UsageError

    with raises_naming(UsageError, *values):
        RunSpec(gen_kwargs=value).validate()
    assert parse_gen_kwargs("temperature=0,top_p=1,top_k=0") == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0}  # the ends of each range are allowed


def test_an_empty_system_instruction_is_refused():
    from lm_eval_headloc.common.checks import UsageError

    with raises_naming(UsageError, "--system-instruction ''"):
        RunSpec(system_instruction=" ").validate()


def _dev_split_task(folder: Path) -> None:
    """An MMLU-shaped task: its few-shot examples are the first of a dev split of 5, the
    questions a test split of 4 (lm-eval's ``first_n`` sampler, as MMLU's YAMLs)."""
    folder.mkdir()
    rows = [{"question": f"{w} sat on the", "choices": ["mat", "dog"], "answer": i % 2}
            for i, w in enumerate(["the cat", "a dog", "Mary", "John", "the dog"])]
    for split, part in (("dev", rows), ("test", rows[:4])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    (folder / "dev_split.yaml").write_text(f"""task: tiny_dev_split
dataset_path: json
dataset_kwargs: {{data_files: {{test: {folder / 'test.jsonl'}, dev: {folder / 'dev.jsonl'}}}}}
test_split: test
fewshot_split: dev
fewshot_config: {{sampler: first_n}}
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}]
""")


def test_as_many_shots_as_a_separate_few_shot_split_holds_are_taken(tiny_model_dir, tmp_path,
                                                                   capsys):
    # MMLU's --num-fewshot 5 from its 5 dev documents per subject: lm-eval draws exactly 5
    # where the few-shot split is not the one asked, so the run measures it as lm-eval
    # does; one more than the split holds is refused before the load.
    import lm_eval

    folder = tmp_path / "tasks"
    _dev_split_task(folder)
    model = tiny_model_dir("llama")
    common = [*tiny_args(model), "--include-path", str(folder), "--tasks", "tiny_dev_split"]
    out = tmp_path / "run"
    assert harness("greedy", *common, "--num-fewshot", "5", "--out", str(out)) == 0
    baseline = json.loads((out / "measurements.jsonl").read_text().splitlines()[0])
    from lm_eval_headloc.tasks import make_task_manager

    reference = lm_eval.simple_evaluate(
        model="hf-headablate", model_args=f"pretrained={model},dtype=float32",
        tasks=["tiny_dev_split"], task_manager=make_task_manager([str(folder)]), device="cpu",
        num_fewshot=5, bootstrap_iters=0)
    assert reference["n-shot"] == {"tiny_dev_split": 5}
    assert baseline["scores"]["tiny_dev_split"] == pytest.approx(
        reference["results"]["tiny_dev_split"]["acc,none"])
    capsys.readouterr()
    assert harness("greedy", *common, "--num-fewshot", "6", "--out", str(tmp_path / "r6")) == 2
    assert_names(last_error(capsys), "--num-fewshot 6", "'tiny_dev_split'", "5 documents",
                 "at most 5")
