"""headloc-harness universal: the heads in the top-k of several tasks' rankings, worked out
by hand from hand-written rankings (ties, places filled by heads that do no harm, a task
ranked by several runs, runs of one model)."""

from __future__ import annotations

import json

import pytest
from helpers import (
    TAMPERED_RANKINGS,
    assert_names,
    error_line,
    harness,
    last_error,
    strict_json,
    tamper,
    write_heads,
)

from lm_eval_headloc.intervention.components import read_heads_file


def test_universal_heads_by_hand(tmp_path, capsys):
    # Three task rankings; top-3 of each: a: L0H1 L2H0 L1H1, b: L2H0 L3H3 L0H1, c: L0H1 ...
    runs = [write_heads(tmp_path / "r1" / "locate", "a", ["L0H1", "L2H0", "L1H1", "L3H3"]),
            write_heads(tmp_path / "r2" / "locate", "b", ["L2H0", "L3H3", "L0H1", "L1H1"]),
            write_heads(tmp_path / "r3" / "locate", "c", ["L0H1", "L1H2", "L3H0", "L2H0"])]
    out = tmp_path / "u.json"
    assert harness("universal", *map(str, runs), "--top-k", "3", "--min-tasks", "2",
                   "--out", str(out)) == 0
    result = strict_json(out)
    # L0H1: in all three (ranks 1+3+1); L2H0: a, b (2+1); L3H3: only b; L1H1: only a.
    assert [h["head"] for h in result["heads"]] == ["L0H1", "L2H0"]
    assert [h["tasks"] for h in result["heads"]] == [3, 2]
    # Two runs whose folders share a name are two rankings, labelled by full path.
    assert len(result["rankings"]) == 3
    assert all(str(tmp_path) in label for label in result["rankings"])
    # Rerunning overwrites our own file; a foreign file or a folder is refused.
    assert harness("universal", *map(str, runs), "--top-k", "3", "--out", str(out)) == 0
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}')
    for target, values in [(foreign, (str(foreign),)),
                           (tmp_path, (str(tmp_path),)),
                           # a run folder it reads (overlap refused it, universal did not)
                           (runs[0] / "u.json", (str(runs[0] / "u.json"), str(runs[0])))]:
        assert harness("universal", *map(str, runs), "--out", str(target)) == 2
        assert_names(last_error(capsys), *values)
    assert foreign.read_text() == '{"mine": true}' and not (runs[0] / "u.json").exists()
    # Runs of different models (even of the same shape) are not compared.
    other = write_heads(tmp_path / "r4", "d", ["L0H1"], model_args="another")
    assert harness("universal", str(runs[0]), str(other), "--out", str(tmp_path / "v.json")) == 2
    assert_names(last_error(capsys), "'m'", "'another'")  # both models


def test_one_run_of_several_tasks_is_enough(tmp_path, capsys):
    """A run of several tasks (locate --tasks a,b) ranks each: its heads shared by both
    are universal, as they are given two runs of one task each. One folder was refused
    ("needs at least 2 run folders"), though its usage line takes one."""
    run = write_heads(tmp_path / "both", "a", ["L0H1", "L2H0", "L1H1"])
    write_heads(tmp_path / "b-alone", "b", ["L2H0", "L3H3", "L0H1"])
    (run / "heads-b.json").write_text((tmp_path / "b-alone" / "heads-b.json").read_text())
    config = strict_json(run / "config.json")
    config["spec"]["tasks"] = config["identity"]["tasks"] = ["a", "b"]
    (run / "config.json").write_text(json.dumps(config))
    out = tmp_path / "u.json"
    assert harness("universal", str(run), "--top-k", "3", "--out", str(out)) == 0
    # Both in the two tasks' top-3, L2H0 by ranks 2 + 1 before L0H1 by 1 + 3.
    assert [h["head"] for h in strict_json(out)["heads"]] == ["L2H0", "L0H1"]
    # One task alone has nothing to share: --min-tasks says so.
    alone = tmp_path / "b-alone"
    assert harness("universal", str(alone), "--out", str(tmp_path / "v.json")) == 2
    assert_names(last_error(capsys), "--min-tasks 2", "only 1 distinct task")


def test_universal_does_not_count_a_tie_broken_by_name(tmp_path, capsys):
    """Task a's 3rd and 4th (L3H3, L1H1) have the same evidence, so its top-3 holds one of
    them by file order only: L3H3 (2nd in b) is undecided, not universal; L1H1, in a's tie
    only, is neither."""
    runs = [write_heads(tmp_path / "r1", "a", ["L0H1", "L2H0", "L3H3", "L1H1"],
                        tied=("L1H1",)),
            write_heads(tmp_path / "r2", "b", ["L2H0", "L3H3", "L0H1", "L1H1"]),
            write_heads(tmp_path / "r3", "c", ["L0H1", "L1H2", "L3H0", "L2H0"])]
    out = tmp_path / "u.json"
    assert harness("universal", *map(str, runs), "--top-k", "3", "--min-tasks", "2",
                   "--out", str(out)) == 0
    printed = capsys.readouterr().out
    result = strict_json(out)
    assert [h["head"] for h in result["heads"]] == ["L0H1", "L2H0"]
    [undecided] = result["undecided"]
    label_a = f"{(tmp_path / 'r1').resolve()}:a"
    assert undecided == {"head": "L3H3", "tasks": 1, "tasks_at_most": 2,
                         "ranks": {f"{(tmp_path / 'r2').resolve()}:b": 2},
                         "tied_in": [label_a]}
    assert result["ties"] == {label_a: {"group": ["L3H3", "L1H1"], "places": 1,
                                        "from_rank": 3}}
    assert "L1H1" not in result["candidates"]
    assert "| L3H3 (undecided) | 1-2 | tie | 2 |  |" in printed
    assert "1 more undecided" in printed
    # --never-ablate / ablate_file read the universal heads only.
    assert read_heads_file(out) == ["L0H1", "L2H0"]
    # A ranking shorter than the top-k is its whole self (a greedy run ranks a few heads).
    longer = write_heads(tmp_path / "r4", "d", ["L5H0", "L5H1", "L5H2", "L5H3", "L5H4"])
    assert harness("universal", *map(str, runs), str(longer), "--top-k", "5", "--out",
                   str(out)) == 0
    assert [h["head"] for h in strict_json(out)["heads"]] == ["L0H1", "L2H0", "L3H3", "L1H1"]


def test_runs_of_one_model_are_one_model_whatever_the_order_and_device(tmp_path, capsys):
    """universal, overlap and cross compared model args as text: the same model with its
    arguments in another order, or run on another device (which a run appends itself),
    was 'different models'."""
    from lm_eval_headloc.intervention.model_args import same_model

    assert same_model("pretrained=m,dtype=float32,device=cpu", "dtype=float32,pretrained=m,"
                                                               "device=cuda")
    assert not same_model("pretrained=m,dtype=float32", "pretrained=m,dtype=bfloat16")
    assert not same_model("pretrained=m", "pretrained=m,peft=a")
    runs = [write_heads(tmp_path / "a", "t", ["L0H1", "L1H0"],
                        model_args="pretrained=m,dtype=float32,device=cpu"),
            write_heads(tmp_path / "b", "t", ["L1H0", "L0H1"],
                        model_args="dtype=float32,pretrained=m,device=cuda,batch_size=4")]
    assert harness("universal", *map(str, runs), "--min-tasks", "1", "--top-k", "2",
                   "--out", str(tmp_path / "u.json")) == 0
    assert harness("overlap", *map(str, runs), "--top-k", "2", "--out",
                   str(tmp_path / "o.json")) == 0
    other = write_heads(tmp_path / "c", "t", ["L0H1"], model_args="pretrained=m,dtype=bfloat16")
    assert harness("overlap", str(runs[0]), str(other), "--top-k", "1", "--out",
                   str(tmp_path / "p.json")) == 2
    assert_names(last_error(capsys), str(other), "'pretrained=m,dtype=bfloat16'")


def test_universal_counts_a_task_once_however_many_runs_rank_it(tmp_path, capsys):
    """Two runs of one task (100 and 10 examples) made its heads 'universal', in 2 tasks."""
    from lm_eval_headloc.commands import universal

    runs = [write_heads(tmp_path / "r1", "induction", ["L0H1", "L1H1", "L2H2"]),
            write_heads(tmp_path / "r2", "induction", ["L0H1", "L2H2", "L3H3"]),
            write_heads(tmp_path / "r3", "ioi", ["L3H3", "L0H0", "L1H0"])]
    result = universal(runs, tmp_path / "u.json", top_k=2, min_tasks=2)
    assert result["heads"] == []  # L0H1 is in two rankings of one task
    assert result["candidates"]["L0H1"] == {f"{(tmp_path / r).resolve()}:induction": 1
                                            for r in ("r1", "r2")}
    result = universal(runs, tmp_path / "u.json", top_k=3, min_tasks=2)
    assert [(h["head"], h["tasks"]) for h in result["heads"]] == [("L3H3", 2)]
    assert harness("universal", *map(str, runs[:2]), "--out", str(tmp_path / "v.json")) == 2
    assert_names(last_error(capsys), "--min-tasks 2", "1")  # the one task, counted once


def test_universal_counts_a_head_only_where_it_hurts(tmp_path):
    """A top-k place filled by a head that does no harm (fewer hurt than k) is no evidence
    that the task needs it: L0H1 is third in both top-3s, but one ranking measured it to
    change nothing, so it is in one task's set, not two."""
    from lm_eval_headloc.commands import universal

    runs = [write_heads(tmp_path / "r1", "a", ["L2H0", "L1H1", "L0H1"],
                        effects=[-0.3, -0.2, 0.0]),
            write_heads(tmp_path / "r2", "b", ["L2H0", "L3H3", "L0H1"],
                        effects=[-0.2, -0.1, -0.05])]
    result = universal(runs, tmp_path / "u.json", top_k=3, min_tasks=2)
    assert [h["head"] for h in result["heads"]] == ["L2H0"]
    assert list(result["candidates"]["L0H1"].values()) == [3]  # task b's only


def test_universal_marks_a_head_within_a_rankings_spread(tmp_path):
    """L0H1 hurts task a by 0.01 where a single knockout gains 0.02 there: counted as
    listed, but marked as within that ranking's spread (it was said only in report.md)."""
    from lm_eval_headloc.commands import universal
    from lm_eval_headloc.commands.universal import universal_table

    runs = [write_heads(tmp_path / "r1", "a", ["L2H0", "L0H1", "L1H1"],
                        effects=[-0.3, -0.01, 0.02]),
            write_heads(tmp_path / "r2", "b", ["L2H0", "L0H1", "L3H3"],
                        effects=[-0.2, -0.1, -0.05])]
    path = runs[0] / "heads-a.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "largest_single_help": {"head": "L1H1",
                                                                "change": 0.02}}))
    result = universal(runs, tmp_path / "u.json", top_k=2, min_tasks=2)
    by_head = {h["head"]: h for h in result["heads"]}
    assert sorted(by_head) == ["L0H1", "L2H0"]
    label = f"{runs[0].resolve()}:a"
    assert by_head["L0H1"]["within_spread_in"] == [label]
    assert "within_spread_in" not in by_head["L2H0"]
    table = universal_table(result)
    assert "| L0H1 | 2 | 2* | 2 |" in table
    assert "*: in that ranking the head hurts the task by no more than a single knockout" in table


@pytest.mark.parametrize("how", list(TAMPERED_RANKINGS))
def test_a_tampered_ranking_file_is_one_line_and_exit_2(tmp_path, capsys, how):
    """Each altered ranking file (``TAMPERED_RANKINGS``) is refused in one line naming the
    file and the field, and no file is written: never a traceback, never a head counted
    from it."""
    heads = ["L0H0", "L0H1", "L0H2", "L0H3", "L0H4"]
    runs = [write_heads(tmp_path / "r1", "a", heads),
            write_heads(tmp_path / "r2", "b", heads[::-1])]
    out = tmp_path / "u.json"
    assert harness("universal", *map(str, runs), "--out", str(out)) == 0  # untouched: read
    out.unlink()
    tamper(runs[0] / "heads-a.json", how)
    capsys.readouterr()
    assert harness("universal", *map(str, runs), "--out", str(out)) == 2
    assert_names(error_line(capsys), str(runs[0]), "heads-a.json", *TAMPERED_RANKINGS[how][1])
    assert not out.exists()


def test_universal_refuses_a_top_k_past_a_ranking_and_runs_of_other_components(tmp_path,
                                                                               capsys):
    """Both were taken: --top-k 100000 over rankings of 4 heads wrote top_k 100000, and a
    heads run beside a neurons run wrote '0 universal heads' (a head is never a neuron)."""
    runs = [write_heads(tmp_path / "r1", "a", ["L0H1", "L2H0", "L1H1", "L3H3"]),
            write_heads(tmp_path / "r2", "b", ["L2H0", "L3H3", "L0H1"])]
    out = tmp_path / "u.json"
    assert harness("universal", *map(str, runs), "--top-k", "5", "--out", str(out)) == 2
    assert_names(last_error(capsys), "--top-k 5", "the longest ranking", "heads-a.json",
                 str(runs[0]), "ranks only 4 components")
    assert harness("universal", *map(str, runs), "--top-k", "4", "--out", str(out)) == 0
    out.unlink()
    neurons = write_heads(tmp_path / "r3", "b", ["L0N1", "L1N2", "L0N3", "L1N0"],
                          components="neurons")
    assert harness("universal", str(runs[0]), str(neurons), "--out", str(out)) == 2
    assert_names(last_error(capsys), str(runs[0]), "heads", str(neurons), "neurons",
                 "--components")
    assert not out.exists()


def test_universal_table_labels_rankings_by_run_number_and_task(tmp_path, capsys):
    """The table's columns were headed by each ranking's full run path and task (unreadable
    beside a head's rank): they are the run's number and the task, the folders below."""
    runs = [write_heads(tmp_path / "some" / "long" / "path" / "r1", "a", ["L0H1", "L2H0"]),
            write_heads(tmp_path / "some" / "long" / "path" / "r2", "b", ["L0H1", "L3H3"])]
    assert harness("universal", *map(str, runs), "--top-k", "2", "--out",
                   str(tmp_path / "u.json")) == 0
    printed = capsys.readouterr().out
    assert ("| head | tasks | 1:a | 2:b |\n| --- | --- | --- | --- |\n| L0H1 | 2 | 1 | 1 |"
            in printed)
    assert f"Runs: 1 = {runs[0].resolve()}; 2 = {runs[1].resolve()}" in printed
    assert "1 universal head written" in printed
    # The file keeps the full labels (FOLDER:task).
    assert strict_json(tmp_path / "u.json")["rankings"] == [f"{runs[0].resolve()}:a",
                                                             f"{runs[1].resolve()}:b"]


def _neuron_run(folder, task: str, neurons: list[str]):
    """A neuron run whose candidates are the neurons it ranks (all it searched)."""
    write_heads(folder, task, neurons, components="neurons")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "candidates": neurons}))
    return folder


def test_universal_neurons_say_what_each_run_never_searched(tmp_path, capsys):
    """Neuron runs printed an empty table and '0 universal heads': each run searches only
    its candidates (its prior's picks on its own task), so a neuron in one task's top-k
    that the other run never searched could not count there, and nothing said so."""
    n1 = _neuron_run(tmp_path / "n1", "a", ["L0N1", "L0N2", "L0N3"])
    n2 = _neuron_run(tmp_path / "n2", "b", ["L1N1", "L1N2", "L1N3"])
    out = tmp_path / "u.json"
    assert harness("universal", str(n1), str(n2), "--top-k", "2", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "| neuron |" not in printed and "| head |" not in printed  # no empty table
    assert "No neuron is in the top-2 of the rankings of 2 or more tasks (--min-tasks 2)." \
        in printed
    assert ("4 of the 4 neurons in a ranking's top-2 were never searched by the run of "
            "another ranking (not among its candidate neurons)") in printed
    assert "0 universal neurons written" in printed
    result = strict_json(out)
    assert result["components"] == "neurons"
    assert result["not_searched"] == {"L0N1": [f"{n2.resolve()}:b"],
                                      "L0N2": [f"{n2.resolve()}:b"],
                                      "L1N1": [f"{n1.resolve()}:a"],
                                      "L1N2": [f"{n1.resolve()}:a"]}
    # A third run that searched both: L0N1 and L1N1 are universal, and where a run never
    # searched one its cell says so (–), not an empty cell (not in its top-k).
    n3 = _neuron_run(tmp_path / "n3", "c", ["L0N1", "L1N1", "L0N9"])
    assert harness("universal", str(n1), str(n2), str(n3), "--top-k", "2", "--out",
                   str(out)) == 0
    printed = capsys.readouterr().out
    assert "| neuron | tasks | 1:a | 2:b | 3:c |" in printed
    assert "| L0N1 | 2 | 1 | – | 1 |" in printed and "| L1N1 | 2 | – | 1 | 2 |" in printed
    assert "–: that ranking's run never searched the neuron." in printed
    assert "2 universal neurons written" in printed
    assert strict_json(out)["heads"][0]["not_searched_in"] == [f"{n2.resolve()}:b"]
    # Heads runs search every head: nothing of the kind is recorded or said.
    heads = [write_heads(tmp_path / f"h{i}", task, ["L0H1", "L1H0"])
             for i, task in enumerate("ab")]
    assert harness("universal", *map(str, heads), "--top-k", "1", "--out", str(out)) == 0
    assert "never searched" not in capsys.readouterr().out
    assert "not_searched" not in strict_json(out)
