"""Run folders that travel: a copy made to be read by someone else is data, never
instructions. A task named as a path, a geometry no model has, files that disagree with
config.json: every command that reads a run folder refuses them in one line before it
builds a path or an array from them, and nothing is written outside the folder."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TASKS, assert_names, error_line, finished_run, harness, raises_naming

from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.record import read_rankings

TASK = "tiny_choice"
OTHER_TASK = "tiny_copy"  # a task that exists too: the disagreeing folder names it
PATH_TASK = "../../../pwned"


def model_args(model: Path) -> list[str]:
    return ["--model-args", f"pretrained={model},dtype=float32", "--include-path", TASKS]


LOCATE = ["--tasks", TASK, "--masks", "12", "--sparsity", "0.25", "--num-samples", "12",
          "--top-k", "3", "--prior", "atp", "--confirm", "0"]
GREEDY = ["--tasks", TASK, "--num-samples", "12", "--top-k", "3"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """A finished locate run (with prior.json) and a finished greedy run of a tiny Llama,
    to copy and alter."""
    model = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("sources")
    assert harness("locate", *model_args(model), *LOCATE, "--out", str(root / "locate")) == 0
    assert (root / "locate" / "prior.json").is_file()
    assert harness("greedy", *model_args(model), *GREEDY, "--out", str(root / "greedy")) == 0
    return {"locate": root / "locate", "greedy": root / "greedy", "model": model}


def _renamed(data, old: str, new: str):
    if isinstance(data, dict):
        return {(new if k == old else k): _renamed(v, old, new) for k, v in data.items()}
    if isinstance(data, list):
        return [_renamed(v, old, new) for v in data]
    return new if data == old else data


def renamed_copy(source: Path, folder: Path, task: str, *, prior: bool = True) -> Path:
    """A copy of ``source`` whose task is called ``task`` in config.json, the measurements
    and the ranking files (and prior.json unless ``prior`` is False), as a crafted copy
    would be made."""
    shutil.copytree(source, folder)
    names = ["config.json", *(["prior.json"] if prior else [])]
    for name in names:
        path = folder / name
        if path.is_file():
            path.write_text(json.dumps(_renamed(json.loads(path.read_text()), TASK, task)))
    lines = (folder / "measurements.jsonl").read_text().splitlines()
    (folder / "measurements.jsonl").write_text("".join(
        json.dumps(_renamed(json.loads(line), TASK, task)) + "\n" for line in lines))
    for suffix in (".json", ".csv"):
        ranking = folder / f"heads-{TASK}{suffix}"
        if ranking.is_file():
            text = ranking.read_text()
            ranking.unlink()
            if "/" not in task:
                (folder / f"heads-{task}{suffix}").write_text(text.replace(TASK, task))
    return folder


def path_named(source: Path, root: Path) -> Path:
    """The issue's folder: a task named ``../../../pwned`` everywhere, an empty folder
    ``heads-..``, and a file of someone else's where ``heads-<task>.json`` resolves to,
    one level above the run folder (a ranking's shape, so a reader would take it)."""
    folder = renamed_copy(source, root / "copy" / "run", PATH_TASK)
    (folder / "heads-..").mkdir()
    ranking = json.loads((source / f"heads-{TASK}.json").read_text())
    for suffix in (".json", ".csv"):
        (root / "copy" / f"pwned{suffix}").write_text(
            json.dumps(ranking) if suffix == ".json" else "someone else's\n")
    return folder


def huge(source: Path, root: Path, layers: int = 2**19) -> Path:
    """config.json saying the model has ``layers`` layers (of 4 heads). The default is
    just past what any model has: enough to be refused, little enough that code which
    does allocate for it (today's main) fails without taking the machine's memory."""
    folder = root / "copy" / "run"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["layers"] = layers
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def disagreeing(source: Path, root: Path) -> Path:
    """config.json, the measurements and the rankings name a task prior.json lacks."""
    return renamed_copy(source, root / "copy" / "run", OTHER_TASK, prior=False)


def count_as_text(source: Path, root: Path) -> Path:
    """config.json whose --top-k is the text '3' (overlap's TypeError; export, universal
    and cross took it)."""
    folder = root / "copy" / "run"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["spec"]["top_k"] = "3"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


CRAFTS = {"path-named task": path_named, "huge geometry": huge,
          "files that disagree": disagreeing, "a count as text": count_as_text}
#: The values each refusal names (the crafted value, and the limit where there is one).
SAID = {"path-named task": (repr(PATH_TASK),), "huge geometry": (f"{2**19} layers", "1,048,576"),
        "files that disagree": ("prior.json", "'tiny_copy'"),
        "a count as text": ("top_k '3'", "whole number")}


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` outside the run folder, with its content."""
    run = root / "copy" / "run"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and run not in p.parents}


def command_line(command: str, folder: Path, runs: dict[str, Path], out: Path,
                 task: str = TASK) -> list[str]:
    """``command`` reading the crafted run ``folder`` (a resumed run: with the command
    that made it, of ``task``, as its owner would rerun it)."""
    model = runs["model"]
    same = [a if a != TASK else task for a in LOCATE]
    return {
        "refit": ["refit", str(folder)],
        "export": ["export", str(folder), "--out", str(out / "x.json")],
        "overlap": ["overlap", str(folder), str(runs["locate"]), "--out",
                    str(out / "o.json")],
        "universal": ["universal", str(folder), str(runs["locate"]), "--min-tasks", "1",
                      "--out", str(out / "u.json")],
        "verify": ["verify", str(folder), "--out", str(out / "v")],
        "cross": ["cross", str(folder), "--out", str(out / "c")],
        "locate (resumed)": ["locate", *model_args(model), *same, "--out", str(folder)],
        "greedy (resumed)": ["greedy", *model_args(model),
                             *[a if a != TASK else task for a in GREEDY], "--out",
                             str(folder)],
        "types (resumed)": ["types", *model_args(model), "--out", str(folder)],
        "sweep (resumed)": ["sweep", *model_args(model), "--tasks", task, "--masks", "4",
                            "--sparsity", "0.25", "--out", str(folder)],
    }[command]


READERS = ["refit", "export", "overlap", "universal", "verify", "cross", "locate (resumed)",
           "types (resumed)", "sweep (resumed)"]
#: types and sweep resume only runs of their own: a locate folder whose config.json passes
#: is refused as another command's, so only the crafts config.json alone shows are theirs.
CASES = [(command, craft) for command in READERS for craft in CRAFTS
         if not (craft == "files that disagree" and command.startswith(("types", "sweep")))]


@pytest.mark.parametrize(("command", "craft"), CASES)
def test_every_command_refuses_a_crafted_locate_folder_in_one_line(
        runs, tmp_path, capsys, no_model_loading, command, craft):
    folder = CRAFTS[craft](runs["locate"], tmp_path)
    before = snapshot(tmp_path)
    task = OTHER_TASK if craft == "files that disagree" else TASK
    capsys.readouterr()
    assert harness(*command_line(command, folder, runs, tmp_path / "out", task)) == 2
    assert_names(error_line(capsys), *SAID[craft])
    assert snapshot(tmp_path) == before  # nothing written outside the run folder
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("craft", list(CRAFTS))
def test_a_resumed_greedy_run_refuses_a_crafted_folder_in_one_line(
        runs, tmp_path, capsys, no_model_loading, craft):
    source = runs["greedy"]
    if craft == "files that disagree":
        # A greedy run has no prior: its measurements disagree with config.json instead.
        folder = renamed_copy(source, tmp_path / "copy" / "run", OTHER_TASK)
        lines = (folder / "measurements.jsonl").read_text().splitlines()
        record = json.loads(lines[-1])
        record["scores"] = {TASK: 0.5}
        (folder / "measurements.jsonl").write_text("\n".join([*lines[:-1],
                                                              json.dumps(record)]) + "\n")
        said = ("measurements.jsonl", repr(record["key"]), repr(OTHER_TASK))
    else:
        folder = CRAFTS[craft](source, tmp_path)
        said = SAID[craft]
    before = snapshot(tmp_path)
    capsys.readouterr()
    task = OTHER_TASK if craft == "files that disagree" else TASK
    assert harness(*command_line("greedy (resumed)", folder, runs, tmp_path / "out",
                                 task)) == 2
    assert_names(error_line(capsys), *said)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("craft", list(CRAFTS))
def test_read_rankings_refuses_a_crafted_folder(runs, tmp_path, craft):
    folder = CRAFTS[craft](runs["locate"], tmp_path)
    before = snapshot(tmp_path)
    with raises_naming(RunFolderError, *SAID[craft]):
        read_rankings(folder)
    assert snapshot(tmp_path) == before


def test_refit_of_a_task_named_as_a_path_writes_nothing_outside_the_folder(
        runs, tmp_path, capsys):
    """The issue's attack: refit wrote pwned.json and pwned.csv one level above the run
    folder, replacing a file that was there."""
    folder = path_named(runs["locate"], tmp_path)
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    line = error_line(capsys)
    assert_names(line, repr(PATH_TASK))
    assert snapshot(tmp_path) == before
    assert (tmp_path / "copy" / "pwned.csv").read_text() == "someone else's\n"


def test_refit_of_a_folder_whose_prior_lacks_its_task_is_one_line(runs, tmp_path, capsys):
    """config.json naming a task prior.json lacks was a KeyError traceback in task_fit."""
    folder = disagreeing(runs["locate"], tmp_path)
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    line = error_line(capsys)
    assert_names(line, "prior.json", "'tiny_copy'", "'tiny_choice'")  # lacks; has


def test_refit_of_a_geometry_the_design_does_not_have_is_one_line(runs, tmp_path, capsys):
    """3 layers of 4 heads is 12 columns, the design has 8: the files disagree."""
    folder = tmp_path / "copy" / "run"
    shutil.copytree(runs["locate"], folder)
    config = json.loads((folder / "config.json").read_text())
    assert (config["layers"], config["heads_per_layer"]) == (2, 4)
    config["layers"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    assert_names(error_line(capsys), "design_matrix.npy", "8", "config.json", "12",
                 "3 layers x 4 heads")


def test_refit_of_a_huge_geometry_allocates_nothing(runs, tmp_path):
    """``"layers": 10**12`` made refit allocate until memory ran out. Run as the command
    is, under a 3 GiB address-space limit, so a refit that allocates fails fast rather
    than taking the machine's memory."""
    folder = huge(runs["locate"], tmp_path, 10**12)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))

    done = subprocess.run(
        [sys.executable, "-c", "import sys; from lm_eval_headloc.cli.main import main; "
                               "sys.exit(main(sys.argv[1:]))", "refit", str(folder)],
        capture_output=True, text=True, timeout=300, preexec_fn=limit,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()  # one line
    assert_names(line, "headloc-harness: error: ", f"{folder}/config.json",
                 "1000000000000 layers", "1,048,576")


def test_a_ranking_file_linked_out_of_the_folder_is_not_read(runs, tmp_path, capsys):
    """heads-<task>.json as a link to a file elsewhere: every path resolves inside the
    folder, so export reads nothing through it."""
    folder = tmp_path / "copy" / "run"
    shutil.copytree(runs["locate"], folder)
    elsewhere = tmp_path / "elsewhere.json"
    (folder / f"heads-{TASK}.json").rename(elsewhere)
    (folder / f"heads-{TASK}.json").symlink_to(elsewhere)
    capsys.readouterr()
    assert harness("export", str(folder), "--out", str(tmp_path / "x.json")) == 2
    assert_names(error_line(capsys), f"heads-{TASK}.json", str(elsewhere))
    assert not (tmp_path / "x.json").exists()


def test_overlap_of_a_heads_run_and_a_neurons_run_is_refused(tiny_model_dir, tmp_path,
                                                              capsys):
    """Heads and MLP neurons are never the same component: overlap printed 0.0 % overlap
    and 0.0 % IoU as if measured."""
    model = tiny_model_dir("llama")
    heads = finished_run(tmp_path / "heads", model, TASK, ("L0H1", "L1H2", "L0H3"))
    neurons = finished_run(tmp_path / "neurons", model, TASK, ("L0N1", "L1N2", "L0N3"))
    capsys.readouterr()
    out = tmp_path / "o.json"
    assert harness("overlap", str(heads), str(neurons), "--top-k", "2",
                   "--out", str(out)) == 2
    assert_names(error_line(capsys), f"{heads}: heads", f"{neurons}: neurons")
    assert not out.exists()


def test_a_greedy_run_is_read_as_a_locate_run_is(runs, tmp_path, capsys):
    """Reading a greedy run's rankings (read_rankings, overlap, universal) was an
    AttributeError: its record had no task names."""
    greedy = runs["greedy"]
    written = json.loads((greedy / f"heads-{TASK}.json").read_text())["top_k"]
    rankings = read_rankings(greedy)
    assert [str(h) for h in rankings[TASK].top(len(written))] == written
    out = tmp_path / "o.json"
    assert harness("overlap", str(greedy), str(runs["locate"]), "--out", str(out)) == 0
    assert json.loads(out.read_text())["tasks"][TASK]["a"]["top_k"] == written
    assert harness("universal", str(greedy), str(runs["locate"]), "--min-tasks", "1",
                   "--out", str(tmp_path / "u.json")) == 0


def test_a_prior_that_lists_no_task_is_said_to_have_none(runs, tmp_path, capsys):
    """prior.json with an empty "tasks": the refusal read "(it has )"."""
    folder = disagreeing(runs["locate"], tmp_path)
    prior = json.loads((runs["locate"] / "prior.json").read_text())
    prior["tasks"] = {}
    (folder / "prior.json").write_text(json.dumps(prior))
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    line = error_line(capsys)
    assert_names(line, "prior.json", "(it has none)")
    assert "(it has )" not in line


@pytest.mark.parametrize("d_model", [2**30, 1, 0, -64, "64", 64.0])
def test_a_forged_width_is_refused_not_copied_into_the_mib_export(runs, tmp_path, capsys,
                                                                  d_model):
    """config.json's d_model went into the MIB export unchecked."""
    folder = tmp_path / "copy" / "run"
    shutil.copytree(runs["locate"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["d_model"] = d_model
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "mib.json"
    capsys.readouterr()
    assert harness("export", str(folder), "--out", str(out)) == 2
    assert_names(error_line(capsys), "d_model", repr(d_model))
    assert not out.exists()


@pytest.mark.parametrize("field, value, said", [
    ("effect", float("nan"), "number as its effect"), ("baseline", "x", "'baseline' is 'x'")])
def test_an_altered_ranking_is_refused_by_the_mib_export(runs, tmp_path, capsys, field,
                                                        value, said):
    """The export read the ranking file unchecked: a NaN effect left a head measured alone
    unscored, a baseline of "x" was copied into the export."""
    folder = tmp_path / "copy" / "run"
    shutil.copytree(runs["locate"], folder)
    path = folder / "heads-tiny_choice.json"
    data = json.loads(path.read_text())
    if field == "effect":
        data["heads"][0]["effect"] = value
    else:
        data[field] = value
    path.write_text(json.dumps(data))
    out = tmp_path / "mib.json"
    capsys.readouterr()
    assert harness("export", str(folder), "--out", str(out)) == 2
    assert_names(error_line(capsys), str(path), said)
    assert not out.exists()


DEEP = "[" * 100_000 + "]" * 100_000
LONG = '{"n": ' + "9" * 5000 + "}"


@pytest.mark.parametrize("text", [DEEP, LONG], ids=["100000-deep", "5000-digit"])
@pytest.mark.parametrize("name", ["config.json", "heads-tiny_choice.json", "prior.json",
                                  "types.json"])
def test_a_json_file_too_deep_or_with_too_long_a_number_is_one_line(runs, tmp_path, capsys,
                                                                    name, text):
    """Each ended in a RecursionError or "Exceeds the limit (4300 digits)" traceback: one
    reader for every JSON file the package reads says which file, in one line."""
    folder = tmp_path / "copy" / "run"
    shutil.copytree(runs["locate"], folder)
    (folder / name).write_text(text)
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    assert_names(error_line(capsys), name)


@pytest.mark.parametrize("text", [DEEP, LONG], ids=["100000-deep", "5000-digit"])
def test_a_head_file_too_deep_or_with_too_long_a_number_is_one_line(tmp_path, text):
    from lm_eval_headloc.intervention.components import ComponentSpecError, read_heads_file

    path = tmp_path / "heads.json"
    path.write_text(text)
    with pytest.raises(ComponentSpecError, match="heads.json") as info:
        read_heads_file(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "null", "1e308", '"0.5"', "true"])
def test_a_measurement_whose_score_is_not_a_number_is_named_not_fitted(runs, tmp_path,
                                                                       capsys, value):
    """NaN, an infinity, null (the package writes a NaN so), 1e308, a string or a bool as a
    score ended refit in sklearn tracebacks, or was fitted as a number (true as 1.0): the
    measurement is named in the log, skipped, and the run is said to be incomplete, with
    what finishes it."""
    folder = tmp_path / "copy"
    shutil.copytree(runs["locate"], folder)
    lines = (folder / "measurements.jsonl").read_text().splitlines()
    record = json.loads(lines[3])
    task, score = next(iter(record["scores"].items()))
    lines[3] = json.dumps(record).replace(f'"scores": {{"{task}": {json.dumps(score)}',
                                          f'"scores": {{"{task}": {value}', 1)
    assert lines[3] != json.dumps(record)
    (folder / "measurements.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert_names(error, "error:", "incomplete", record["key"], "rerun the locate command")
    assert "(1 measurement missing, e.g." in error  # not '1 measurements'
    assert_names(warning, "warning:", "line 4", record["key"], repr(task),
                 "not a finite number", "measures it again")


@pytest.mark.parametrize("alter", [
    lambda d: d.update(heads=[]),
    lambda d: d.pop("heads"),
    lambda d: d.update(largest_single_help={"head": "L0H1", "change": "x"}),
    lambda d: d.update(certificate={"certified": True, "forged": 1}),
    lambda d: d["heads"][0].update(effect="abc"),
    # NaN read as "recorded to do no harm", a measured head left unscored in the export.
    lambda d: d["heads"][0].update(effect=float("nan")),
    lambda d: d.update(baseline="x"),  # copied into the MIB export
], ids=["no heads", "heads missing", "help not a number", "certificate forged",
        "effect text", "effect NaN", "baseline text"])
def test_read_rankings_of_an_altered_ranking_file_is_one_line(runs, tmp_path, alter):
    """read_rankings raised TypeError: CertificateRecord.__init__() got an unexpected
    keyword argument on a tampered file, and others ended in tracebacks."""
    from lm_eval_headloc import read_rankings
    from lm_eval_headloc.runs.folder_checks import RunFolderError

    folder = tmp_path / "copy"
    shutil.copytree(runs["locate"], folder)
    path = folder / "heads-tiny_choice.json"
    data = json.loads(path.read_text())
    data.setdefault("certificate", None)
    alter(data)
    path.write_text(json.dumps(data))
    with pytest.raises(RunFolderError) as info:
        read_rankings(folder)
    assert "\n" not in str(info.value) and "heads-tiny_choice.json" in str(info.value)


def test_a_design_that_no_longer_matches_its_measurements_is_refused(runs, tmp_path, capsys):
    """design_matrix.npy whose rows no longer match the recorded masks was fitted (rc 0, a
    different top-3): the measurements are the record."""
    import numpy as np

    folder = tmp_path / "copy"
    shutil.copytree(runs["locate"], folder)
    design = np.load(folder / "design_matrix.npy")
    design[2] = ~design[2]
    np.save(folder / "design_matrix.npy", design)
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    assert_names(error_line(capsys), "design_matrix.npy", "row 2", "mask-0002", "altered")


def test_a_key_measured_twice_with_other_scores_is_refused(runs, tmp_path, capsys):
    """A duplicated key with another score: the later won, and 27 heads became "ruled
    out"."""
    folder = tmp_path / "copy"
    shutil.copytree(runs["locate"], folder)
    lines = (folder / "measurements.jsonl").read_text().splitlines()
    record = json.loads(lines[3])
    record["scores"] = {task: 0.0 for task in record["scores"]}
    lines.append(json.dumps(record))
    (folder / "measurements.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    assert_names(error_line(capsys), "measurements.jsonl", record["key"], "twice")


def test_a_measurement_that_flips_the_tasks_direction_is_refused(runs, tmp_path, capsys):
    """A per-line flip of higher_is_better was fitted silently."""
    folder = tmp_path / "copy"
    shutil.copytree(runs["locate"], folder)
    lines = (folder / "measurements.jsonl").read_text().splitlines()
    record = json.loads(lines[3])
    task = next(iter(record["higher_is_better"]))
    record["higher_is_better"][task] = not record["higher_is_better"][task]
    lines[3] = json.dumps(record)
    (folder / "measurements.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    assert_names(error_line(capsys), record["key"], "higher_is_better", repr(task))


@pytest.mark.parametrize("keys", [lambda n: ["mask-0000"] * n, lambda n: ["mask-0000"]],
                         ids=["all equal", "short"])
def test_row_keys_that_do_not_name_a_measurement_a_row_are_refused(runs, tmp_path, capsys,
                                                                   keys):
    folder = tmp_path / "copy"
    shutil.copytree(runs["locate"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["row_keys"] = keys(config["masks_used"])
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert harness("refit", str(folder)) == 2
    assert_names(error_line(capsys), "row_keys", "config.json")


def _recording(runs, tmp_path, **recorded) -> Path:
    """A copy of the locate run whose config.json records ``recorded`` (spec and
    identity), with a task folder inside it whose utils.py would leave a mark if run."""
    folder = tmp_path / "copy" / "run"
    shutil.copytree(runs["locate"], folder)
    shutil.copytree(Path(TASKS) / TASK, folder / "tasks" / TASK)
    (folder / "tasks" / TASK / "utils.py").write_text(
        f"open({str(tmp_path / 'marked')!r}, 'w').write('ran')\n"
        + (Path(TASKS) / TASK / "utils.py").read_text())
    config = json.loads((folder / "config.json").read_text())
    for part in ("spec", "identity"):
        config[part].update(recorded)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("command", ["verify", "cross"])
@pytest.mark.parametrize("craft, said", [
    ("relative", ("include_path 'tasks'", "relative")),
    ("inside", ("include_path", "inside the run folder")),
    ("remote code", ("trust_remote_code=True",)),
])
def test_a_run_folders_record_names_no_code_to_run(runs, tmp_path, capsys, no_model_loading,
                                                   command, craft, said):
    """verify and cross took a run's recorded include_path (a task folder shipped inside
    the run folder, whose utils.py then ran) and its model_args' trust_remote_code=True
    (the model's own code) as given: a run folder is data. Refused in one line, before
    any task or model loads."""
    copy = tmp_path / "copy" / "run"
    recorded = {"relative": {"include_path": ["tasks"]},
                "inside": {"include_path": [str(copy / "tasks")]},
                "remote code": {"model_args": f"pretrained={runs['model']},dtype=float32,"
                                              "device=cpu,trust_remote_code=True"}}[craft]
    folder = _recording(runs, tmp_path, **recorded)
    out = tmp_path / "out"
    args = {"verify": ["verify", str(folder), "--general", OTHER_TASK, "--out", str(out)],
            "cross": ["cross", str(folder), "--out", str(out)]}[command]
    capsys.readouterr()
    assert harness(*args) == 2
    assert_names(error_line(capsys), str(folder / "config.json"), *said)
    assert not (tmp_path / "marked").exists() and not out.exists()


@pytest.mark.parametrize("command", ["verify", "cross"])
def test_a_record_of_no_ranking_command_is_refused_by_verify_and_cross(
        runs, tmp_path, capsys, no_model_loading, command):
    """config.json saying command "rm -rf /" was refused by refit, export, overlap and
    universal, but verify and cross read its heads and measured them."""
    folder = tmp_path / "copy" / "run"
    shutil.copytree(runs["locate"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["command"] = "rm -rf /"
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    capsys.readouterr()
    assert harness(command, str(folder), *(["--general", OTHER_TASK] if command == "verify"
                                           else []), "--out", str(out)) == 2
    assert_names(error_line(capsys), str(folder), "rm -rf / run", "locate or greedy")
    assert not out.exists()


@pytest.mark.parametrize("command", ["verify", "cross"])
def test_a_task_recorded_as_a_yaml_file_runs_no_code_from_the_working_directory(
        runs, tmp_path, capsys, monkeypatch, no_model_loading, command):
    """A task recorded as 'evil.yaml' (a plain name: no '/') was read by verify and cross
    as a task file's path, relative to the working directory: run from inside the copy,
    its YAML and the Python function it names, shipped in the folder, ran. Refused in
    one line, before any task loads."""
    folder = renamed_copy(runs["locate"], tmp_path / "copy" / "run", "evil.yaml")
    yaml = (Path(TASKS) / TASK / f"{TASK}.yaml").read_text()
    (folder / "evil.yaml").write_text(yaml.replace(f"task: {TASK}", "task: evil.yaml"))
    (folder / "utils.py").write_text(
        f"open({str(tmp_path / 'marked')!r}, 'w').write('ran')\n"
        + (Path(TASKS) / TASK / "utils.py").read_text())
    out = tmp_path / "out"
    monkeypatch.chdir(folder)
    args = {"verify": ["verify", ".", "--general", OTHER_TASK, "--random-draws", "0",
                       "--out", str(out)],
            "cross": ["cross", ".", "--out", str(out)]}[command]
    capsys.readouterr()
    assert harness(*args) == 2
    assert_names(error_line(capsys), "'evil.yaml'", "task file")
    assert not (tmp_path / "marked").exists() and not out.exists()


def _with_config(runs, tmp_path, alter) -> Path:
    folder = tmp_path / "copy" / "run"
    shutil.copytree(runs["locate"], folder)
    config = json.loads((folder / "config.json").read_text())
    alter(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("field", "value", "said"), [
    ("top_k", None, "top_k None"),  # refit: '>' between None and int
    ("scale", None, "scale None"),  # refit: float(None)
    ("model_args", 5, "--model-args 5"),  # verify: 5.split
    ("model_args", ["pretrained=x"], "--model-args"),
    ("include_path", [5], "include_path [5]"),  # verify: os.fspath(5)
    ("alpha", "x", "--alpha 'x'"),
])
@pytest.mark.parametrize("command", ["refit", "verify", "overlap"])
def test_a_recorded_option_of_the_wrong_type_is_one_line(runs, tmp_path, capsys,
                                                          no_model_loading, field, value,
                                                          said, command):
    """A recorded option the command line would refuse (null where a number is, model
    args or include_path that are no strings) ended in a traceback deep in the command:
    config.json is named, with the option."""
    folder = _with_config(runs, tmp_path, lambda c: c["spec"].__setitem__(field, value))
    capsys.readouterr()
    assert harness(*command_line(command, folder, runs, tmp_path / "out")) == 2
    assert_names(error_line(capsys), "config.json", said)


@pytest.mark.parametrize(("field", "value"), [
    ("example_subset", None), ("example_subset", "0,1"), ("example_subset", [-1, 0]),
    ("example_subset", [0.5]), ("examples_used", "4"), ("examples_used", -1)])
def test_a_recorded_example_subset_that_is_no_list_of_indices_is_one_line(
        runs, tmp_path, capsys, field, value):
    """overlap took len() of a task's subset recorded as null (a TypeError) and counted a
    string's characters as examples; negative or fractional indices passed silently."""
    folder = _with_config(runs, tmp_path, lambda c: c[field].__setitem__(TASK, value))
    capsys.readouterr()
    assert harness(*command_line("overlap", folder, runs, tmp_path / "out")) == 2
    assert_names(error_line(capsys), "config.json", field, repr(TASK))
    with raises_naming(RunFolderError, field):
        read_rankings(folder)
