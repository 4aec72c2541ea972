"""headloc-harness verify: the top-k knocked out by hf-headablate itself (the table, what a
run's signal and example part mean for it, its default general tasks), and a finished
verify or cross rerun without loading the model."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from helpers import (
    LASSO_ONLY,
    TASKS,
    assert_names,
    fake_run,
    finished_run,
    harness,
    last_error,
    lose_last_measurement_and_count_loads,
    raises_naming,
    strict_json,
    tiny_args,
)

from lm_eval_headloc.intervention.components import Head


def test_verify_table(tiny_model_dir, tiny_locate_run, tmp_path, capsys):
    run = tiny_locate_run
    out = tmp_path / "verify"
    assert harness("verify", str(run), "--top-k", "3", "--general", "tiny_copy",
                   "--out", str(out)) == 0
    table = strict_json(out / "verify.json")
    rows = table["rows"]["tiny_choice"]
    assert [r["k"] for r in rows] == [1, 2, 3]
    assert rows[2]["heads"] == strict_json(run / "heads.json")["top_k"][:3]
    base = table["baseline"]["tiny_choice"]
    drop = (base - rows[0]["score"]) / base if base else None
    assert rows[0]["task_drop"] == (pytest.approx(drop) if drop is not None else None)
    assert "| k | heads | score | Task drop | Gen drop | tiny_copy |" in (
        out / "verify.md").read_text()
    # Its first row is what each drop is from, the general tasks' baselines too (they were
    # in verify.json only).
    general = table["baseline"]["tiny_copy"]
    assert (f"| 0 | none (baseline) | {base:.4f} | – | – | {general:.4f} |\n"
            f"| 1 | {rows[0]['heads'][0]} |") in (out / "verify.md").read_text()
    assert table["located_by"] == "metric"
    assert "log-likelihood" not in (out / "verify.md").read_text()
    # What the run's ranking says of these heads travels with them (the run's own file).
    from lm_eval_headloc.commands.verify import ranking_notes, verification_markdown
    from lm_eval_headloc.runs.folder import RunFolder

    assert table["ranking_notes"] == {"tiny_choice": ranking_notes(RunFolder(run),
                                                                   "tiny_choice", 3)}
    table["ranking_notes"] = {"tiny_choice": ["L0H1: recorded to do no harm"]}
    assert ("What the run's ranking says of these (its report.md):\n"
            "- L0H1: recorded to do no harm\n") in verification_markdown(table)
    # verify's scores are fresh evaluations: heads knocked out by hf-headablate itself.
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    lm = HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), dtype="float32",
                        device="cpu", ablate="+".join(rows[1]["heads"]))
    import lm_eval

    from lm_eval_headloc.tasks import make_task_manager

    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_choice"],
                                      task_manager=make_task_manager([TASKS]))
    assert rows[1]["score"] == pytest.approx(results["results"]["tiny_choice"]["acc,none"])


def test_verify_of_a_logprob_run_says_it_scores_by_the_metric(tiny_model_dir, tmp_path):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    config = strict_json(run / "config.json")
    for part in ("spec", "identity"):
        config[part]["signal"] = "logprob"
    (run / "config.json").write_text(json.dumps(config))
    out = tmp_path / "verify"
    assert harness("verify", str(run), "--top-k", "1", "--general", "tiny_choice",
                   "--random-draws", "0", "--limit", "4", "--out", str(out)) == 0
    assert strict_json(out / "verify.json")["located_by"] == "logprob"
    assert "The run located these by the gold answers' log-likelihood" in (
        out / "verify.md").read_text()


def test_verify_of_a_run_on_part_of_the_examples_measures_whole_tasks(tiny_model_dir,
                                                                      tmp_path):
    """A run located on --examples-part 1/2 is verified on whole tasks (or --limit's first
    documents), as verify's options say: the part used to cut the general tasks too, and
    --limit silently dropped it."""
    run = tmp_path / "part"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--examples-part", "1/2", "--masks", "4", "--sparsity", "0.25",
                   *LASSO_ONLY, "--out", str(run)) == 0
    assert strict_json(run / "config.json")["examples_used"] == {"tiny_choice": 2}
    for limit, used in (([], {"tiny_choice": 4, "tiny_copy": 12}),
                        (["--limit", "3"], {"tiny_choice": 3, "tiny_copy": 3})):
        out = tmp_path / f"verify{len(limit)}"
        assert harness("verify", str(run), "--top-k", "1", "--general", "tiny_copy",
                       "--random-draws", "0", *limit, "--out", str(out)) == 0
        config = strict_json(out / "config.json")
        assert config["examples_used"] == used
        assert config["spec"]["examples_part"] is None


def test_a_finished_verify_or_cross_reruns_without_loading_the_model(
        tiny_model_dir, tiny_locate_run, tmp_path, monkeypatch):
    """Every measurement on disk: the tables are rewritten from it, no weights loaded; one
    measurement lost: the model is loaded to measure it again."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    out, cross_out = tmp_path / "verify", tmp_path / "cross"
    verify_args = ["verify", str(tiny_locate_run), "--top-k", "2", "--general", "tiny_copy",
                   "--out", str(out)]
    cross_args = ["cross", str(tiny_locate_run), "--top-k", "2", "--out", str(cross_out)]
    assert harness(*verify_args) == 0 and harness(*cross_args) == 0
    tables = {path: path.read_text() for path in (out / "verify.json", out / "verify.md",
                                                  cross_out / "cross.json")}
    for path in tables:
        path.unlink()

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    with monkeypatch.context() as patched:
        patched.setattr(HFHeadAblateLM, "__init__", refuse)
        assert harness(*verify_args) == 0 and harness(*cross_args) == 0
    assert {path: path.read_text() for path in tables} == tables
    # A measurement lost: measured again, so the model loads (and the table is the same).
    loads = lose_last_measurement_and_count_loads(out, monkeypatch)
    assert harness(*verify_args) == 0
    assert loads == [1]
    assert (out / "verify.json").read_text() == tables[out / "verify.json"]


def test_verify_defaults_to_offline_general_tasks_for_the_embedded_model(tiny_model_dir,
                                                                        tmp_path, capsys,
                                                                        no_model_loading):
    from lm_eval_headloc.commands.verify import DEFAULT_GENERAL, OFFLINE_GENERAL
    from lm_eval_headloc.intervention.embedded import is_embedded

    assert is_embedded(None)
    assert not is_embedded(f"pretrained={tiny_model_dir('llama')}")
    assert "hellaswag" in DEFAULT_GENERAL and "headloc_ioi" in OFFLINE_GENERAL
    # Another model offline: the paper's general tasks cannot be had; one line, a hint.
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    assert harness("verify", str(run)) == 2
    assert_names(last_error(capsys), "cannot load task 'hellaswag'", "headloc_ioi")


@pytest.mark.parametrize(("heads", "said"), [
    (("L1H2",), "ranks only 1 head"),
    (("L1N5",), "ranks only 1 MLP neuron"),
    (("L1H2", "L1N5"), "ranks only 2 components"),
])
def test_a_top_k_past_the_ranking_names_its_count_and_kind(heads, said, tmp_path):
    """The refusal counts what the ranking holds in its own words ('ranks only 1 heads'
    was the plural cut by hand); no model is loaded to say it."""
    from lm_eval_headloc.commands.verify import located_heads
    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.runs.folder import RunFolder

    run = finished_run(tmp_path / "run", tmp_path / "no-model", "tiny_copy", heads)
    with pytest.raises(UsageError) as refused:
        located_heads(RunFolder(run), "tiny_copy", top_k=3)
    assert str(refused.value) == f"--top-k 3: heads-tiny_copy.json {said}"


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_notes_say_why_a_harmless_head_is_listed_by_where_it_stands(tmp_path,
                                                                    higher_is_better):
    """A head recorded to do no harm ranked above one that hurts was said to be "listed
    because fewer hurt", as if the harmless ones sat at the end of the top-k; only those
    after the last that hurts are. Lower is better: a rise hurts."""
    from lm_eval_headloc.commands.verify import ranking_notes
    from lm_eval_headloc.runs.folder import RunFolder

    sign = 1 if higher_is_better else -1
    run = tmp_path / "run"
    run.mkdir()
    effects = {"L0H0": -0.2, "L0H1": 0.0, "L0H2": 0.01, "L0H3": -0.1, "L1H0": 0.0}
    (run / "heads-t.json").write_text(json.dumps({
        "task": "t", "higher_is_better": higher_is_better,
        "heads": [{"rank": r, "head": h, "effect": sign * e}
                  for r, (h, e) in enumerate(effects.items(), start=1)]}))
    assert ranking_notes(RunFolder(run), "t", 5) == [
        "L0H1: recorded to do no harm, yet ranked above L0H3, which hurts the task: listed "
        "for its place in that order, not because fewer hurt",
        "L0H2: recorded to do no harm, yet ranked above L0H3, which hurts the task: listed "
        "for its place in that order, not because fewer hurt",
        "L1H0: recorded to do no harm, listed because fewer hurt"]
    # The top-3 has no head that hurts after them: places filled because fewer hurt.
    assert ranking_notes(RunFolder(run), "t", 3) == [
        "L0H1, L0H2: recorded to do no harm, listed because fewer hurt"]


def _reversed(data: dict) -> None:
    """Its list reversed, its ranks and top_k made to agree: an order the run never gave."""
    heads = [{**entry, "rank": rank}
             for rank, entry in enumerate(reversed(data["heads"]), start=1)]
    data.update(heads=heads, top_k=[entry["head"] for entry in heads[:len(data["top_k"])]])


#: A run's ranking file altered out of the order its writer gives it, each with what the
#: refusal names: verify knocked out the altered list's first heads as the run's top-k.
OUT_OF_ORDER = {
    "reversed": (_reversed, ("not in ranked order", "harms the task more")),
    "top_k not its first heads": (
        lambda data: data.update(top_k=[e["head"] for e in data["heads"][-2:]]),
        ("'top_k'", "not the first 2")),
    "rank not its place": (lambda data: data["heads"][0].update(rank=2), ("rank 2",)),
}


@pytest.mark.parametrize("how", list(OUT_OF_ORDER))
def test_verify_refuses_a_ranking_out_of_its_order_before_the_model_loads(
        how, tiny_locate_run, tmp_path, capsys, no_model_loading):
    run = tmp_path / "run"
    shutil.copytree(tiny_locate_run, run)
    path = run / "heads-tiny_choice.json"
    data = json.loads(path.read_text())
    assert len({entry["effect"] for entry in data["heads"]}) > 1  # an order to alter
    OUT_OF_ORDER[how][0](data)
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert harness("verify", str(run), "--top-k", "2", "--general", "tiny_copy",
                   "--out", str(tmp_path / "verify")) == 2
    assert_names(last_error(capsys), "heads-tiny_choice.json", *OUT_OF_ORDER[how][1])


def test_the_orders_the_rankers_write_are_read_and_a_swap_within_one_is_not(tmp_path):
    """Not every ranking is in harm order from top to bottom: locate's estimates that hurt
    come after the heads measured alone that hurt, however large; iterative greedy's
    winners lead in the order they won. Each kind of evidence is in harm order within."""
    from lm_eval_headloc.commands.greedy import _rankings
    from lm_eval_headloc.method.columns import Columns
    from lm_eval_headloc.method.rank import confirmed_order
    from lm_eval_headloc.method.ranking import Ranking, RankingFacts, ranked_heads_json
    from lm_eval_headloc.runs.folder_checks import RunFolderError
    from lm_eval_headloc.runs.record import read_ranking_file

    four = Columns.heads(2, 2)
    # Measured alone: L0H0 hurts by 0.1, L1H1 not at all; estimated: L0H1 hurts by 0.5.
    effects = np.array([-0.1, -0.5, 0.02, 0.0])
    order = confirmed_order({0: (-0.1, 0.0), 3: (0.0, 0.0)}, [1, 2], True,
                            screen_effects=effects)
    assert order == [0, 1, 3, 2]
    located = Ranking("t", "acc", True, 0.5, effects, order, 2, columns=four,
                      facts=RankingFacts(method="compressed sensing (Lasso), the likeliest "
                                                "heads measured alone",
                                         confirmed=["L0H0", "L1H1"]))
    # Iterative greedy: L0H1 won round 2 measuring -0.01, above L0H0's -0.20.
    baseline = {"scores": {"acc": 0.6}, "metrics": {"acc": "acc"},
                "higher_is_better": {"acc": True}}
    changes = {"acc": {2: (-0.30, 0.0), 1: (-0.01, 0.0), 0: (-0.20, 0.0), 3: (-0.05, 0.0)}}
    won = _rankings(changes, [Head(1, 0), Head(0, 1)], baseline, 2, four, 2, 9)["acc"]
    assert won.order == [2, 1, 0, 3]
    for name, ranking in (("located", located), ("won", won)):
        path = tmp_path / f"heads-{name}.json"
        path.write_text(json.dumps(ranked_heads_json(ranking, 2)))
        assert [e["head"] for e in read_ranking_file(path)["heads"]] == [
            str(four[h]) for h in ranking.order]
    # Within one kind of evidence the order is harm's: L0H0 and L1H1 (both measured
    # alone) swapped, or iterative greedy's L0H0 and L1H1 after its winners.
    for name, (i, j) in (("located", (0, 2)), ("won", (2, 3))):
        path = tmp_path / f"heads-{name}.json"
        data = json.loads(path.read_text())
        heads = data["heads"]
        heads[i], heads[j] = ({**heads[j], "rank": i + 1}, {**heads[i], "rank": j + 1})
        data["top_k"] = [e["head"] for e in heads[:2]]
        path.write_text(json.dumps(data))
        with raises_naming(RunFolderError, path.name, "not in ranked order"):
            read_ranking_file(path)


def test_the_gen_drop_says_which_general_tasks_it_leaves_out():
    # A general task at a zero baseline has no relative drop (n/a): Gen was the mean over
    # the others while the note said it was over all of them.
    from lm_eval_headloc.commands.verify import effect, verification_markdown

    general = ["zero", "half"]
    base = {"scores": {"task": 0.5, "zero": 0.0, "half": 0.5},
            "higher_is_better": {"task": True, "zero": True, "half": True}}
    row = effect(base, {"scores": {"task": 0.25, "zero": 0.25, "half": 0.25}}, "task", general)
    assert row["gen_drop"] == pytest.approx(0.5)  # half's alone
    table = {"general": general, "scale": 0.0, "ablation": "zero", "random_draws": 0,
             "metrics": {"task": "acc,none"}, "baseline": base["scores"],
             "rows": {"task": [{"k": 1, "heads": ["L0H0"], **row}]}}
    text = verification_markdown(table)
    assert "Gen is the mean over the general tasks: zero, half (less zero, whose baseline " \
           "is 0)." in text
    table["baseline"] = {**base["scores"], "zero": 0.1}
    assert "Gen is the mean over the general tasks: zero, half." in verification_markdown(table)


def _verify_options() -> set[str]:
    from lm_eval_headloc.cli.main import build_parser

    parser = build_parser()
    verify = next(a for a in parser._subparsers._group_actions).choices["verify"]
    return {flag for action in verify._actions for flag in action.option_strings}


def test_verify_of_a_logprob_run_shortens_a_generation_too_long_for_the_model(
        tiny_model_dir, tmp_path, capsys):
    """A logprob run on a task that generates lm-eval's 256 tokens where the tiny model
    takes 128: locate generates nothing, verify scores the task's metric and so
    generates. Its refusal names an option verify has, and verify --gen-kwargs shortens
    the generation, recorded in what it writes (it had no --gen-kwargs: the run could
    never be verified on its model)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "long.yaml").write_text(
        f"include: {TASKS}/tiny_generate/tiny_generate.yaml\ntask: tiny_long_generate\n"
        "generation_kwargs: {until: ['\\n'], do_sample: false}\n")
    run = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--include-path",
                   str(tasks), "--tasks", "tiny_long_generate", "--signal", "logprob",
                   "--num-samples", "4", "--masks", "4", *LASSO_ONLY,
                   "--out", str(run)) == 0
    common = ["verify", str(run), "--top-k", "1", "--general", "tiny_copy",
              "--random-draws", "0", "--limit", "2"]
    capsys.readouterr()
    assert harness(*common, "--out", str(tmp_path / "refused")) == 2
    said = last_error(capsys)
    assert_names(said, "'tiny_long_generate'", "256", "128 tokens", "--gen-kwargs max_gen_toks=N")
    assert set(re.findall(r"--[a-z][a-z_-]*", said)) <= _verify_options()
    out = tmp_path / "verify"
    assert harness(*common, "--gen-kwargs", "max_gen_toks=4", "--out", str(out)) == 0
    table = strict_json(out / "verify.json")
    assert (table["gen_kwargs"], table["run_gen_kwargs"]) == ('{"max_gen_toks": 4}', None)
    assert strict_json(out / "config.json")["spec"]["gen_kwargs"] == '{"max_gen_toks": 4}'
    assert "`{\"max_gen_toks\": 4}` (verify's --gen-kwargs" in (out / "verify.md").read_text()


def test_verify_generates_as_the_run_did_unless_given_other_gen_kwargs(tiny_model_dir,
                                                                       tmp_path):
    run = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_generate",
                   "--gen-kwargs", "max_gen_toks=2", "--num-samples", "4", "--masks", "4",
                   *LASSO_ONLY, "--out", str(run)) == 0
    common = ["verify", str(run), "--top-k", "1", "--general", "tiny_copy",
              "--random-draws", "0", "--limit", "2"]
    inherited = tmp_path / "inherited"
    assert harness(*common, "--out", str(inherited)) == 0
    table = strict_json(inherited / "verify.json")
    assert table["gen_kwargs"] == '{"max_gen_toks": 2}' and "run_gen_kwargs" not in table
    assert strict_json(inherited / "config.json")["spec"]["gen_kwargs"] == table["gen_kwargs"]
    assert "(the run's --gen-kwargs" in (inherited / "verify.md").read_text()
    other = tmp_path / "other"
    assert harness(*common, "--gen_kwargs", "max_gen_toks=3", "--out", str(other)) == 0
    table = strict_json(other / "verify.json")
    assert (table["gen_kwargs"], table["run_gen_kwargs"]) == ('{"max_gen_toks": 3}',
                                                              '{"max_gen_toks": 2}')
    assert "not the run's (it gave `{\"max_gen_toks\": 2}`)" in (other / "verify.md").read_text()


def test_ctrl_c_in_a_verify_into_its_default_folder_says_how_to_resume(
        tiny_locate_run, tmp_path, monkeypatch, capsys):
    """A verify without --out (its folder RUN/verify) stopped by Ctrl-C after its first
    measurement said "it had not started its run folder, so nothing is kept": its folder
    held config.json and the measurement, which the rerun continues from."""
    from lm_eval_headloc.runs.folder import RunFolder

    append = RunFolder.append_measurement

    def stopped(self, record):
        append(self, record)
        raise KeyboardInterrupt

    run = shutil.copytree(tiny_locate_run, tmp_path / "run")  # the module's run stays bare
    args = ["verify", str(run), "--top-k", "2", "--general", "tiny_copy", "--random-draws",
            "0"]
    monkeypatch.setattr(RunFolder, "append_measurement", stopped)
    assert harness(*args) == 130
    assert last_error(capsys).endswith("interrupted; rerun the same command to continue")
    assert len((run / "verify" / "measurements.jsonl").read_text().splitlines()) == 1
