"""benchmarks/bench_stop_checks.py: the row stops' cost a step, its section."""

from __future__ import annotations

import re

import pytest

from headloc_bench import bench_stop_checks as bench


def test_the_stop_checks_section_counts_the_rows_each_table_decodes(tmp_path):
    out = tmp_path / "BENCH.md"
    assert bench.main(["--rows", "40,80", "--steps", "4", "--repeats", "1",
                       "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!-- bench_stop_checks: start -->")
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \| (the [^|]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      text, flags=re.MULTILINE)
    ways = [("byte ids", "the model's vocabulary"),
            ("any of 128,256 ids", "the model's vocabulary"),
            ("any of 128,256 ids", "the tokenizer's only")]
    assert [(r, ids, table) for r, ids, table, _, _ in rows] == [
        (count, *way) for count in ("40", "80") for way in ways]
    # Byte ids: a row is looked at when its new byte is the stop string's last character
    # (1 of 256). Ids over 128,256 of which the tokenizer knows 258 (0.2 %): over the
    # tokenizer's table nearly every row is decoded a step, over the model's nearly none.
    for count, _ids, table, decoded, per_step in rows:
        share = float(decoded) / int(count)
        assert share >= 0.95 if table == "the tokenizer's only" else share <= 0.05
        assert float(per_step) > 0


@pytest.mark.parametrize("argv", [["--rows", "x"], ["--rows", "0"], ["--steps", "1"],
                                  ["--rows", "1000000000"], ["--steps", "nan"]])
def test_bad_options_are_one_line(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main([*argv, "--out", str(tmp_path / "B.md")])
    assert stopped.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()[-1]) < 200
