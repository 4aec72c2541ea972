"""BENCH.md's writers each replace only their own part (scripts/bench_sections.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_sections.py"
_spec = importlib.util.spec_from_file_location("bench_sections", SCRIPT)
bench_sections = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_sections)

FILE = """# CPU head

cpu table

<!-- bench_workers: start -->

## Workers

cpu workers

<!-- bench_workers: end -->
"""


def test_a_gpu_section_is_appended_then_replaced_leaving_the_rest_byte_for_byte(tmp_path):
    bench = tmp_path / "BENCH.md"
    bench.write_text(FILE, encoding="utf-8")
    name = bench_sections.section_name("bench_measure", "cuda")
    assert name == "bench_measure cuda"
    bench_sections.write_section(bench, name, "## GPU\n\nfirst")
    assert bench.read_text(encoding="utf-8") == FILE + (
        "\n<!-- bench_measure cuda: start -->\n\n## GPU\n\nfirst\n\n"
        "<!-- bench_measure cuda: end -->\n")
    bench_sections.write_section(bench, name, "## GPU\n\nsecond")
    text = bench.read_text(encoding="utf-8")
    assert text.startswith(FILE) and "second" in text and "first" not in text
    assert text.count("bench_measure cuda: start") == 1


def test_the_cpu_head_is_replaced_and_every_section_kept(tmp_path):
    bench = tmp_path / "BENCH.md"
    bench.write_text(FILE + "\n<!-- bench_measure cuda: start -->\n\ngpu\n\n"
                     "<!-- bench_measure cuda: end -->\n", encoding="utf-8")
    bench_sections.write_head(bench, "# New head\n\nnew cpu table\n")
    assert bench.read_text(encoding="utf-8") == (
        "# New head\n\nnew cpu table\n\n"
        "<!-- bench_workers: start -->\n\n## Workers\n\ncpu workers\n\n"
        "<!-- bench_workers: end -->\n\n"
        "<!-- bench_measure cuda: start -->\n\ngpu\n\n<!-- bench_measure cuda: end -->\n")


def test_cpu_sections_keep_their_old_marker_name():
    assert bench_sections.section_name("bench_workers", "cpu") == "bench_workers"


def test_demote_moves_headings_down_but_not_inside_code_blocks():
    text = "# Title\n\n## Part\n\n```bash\n# a shell comment\n```\n#hashtag"
    assert bench_sections.demote(text) == (
        "## Title\n\n### Part\n\n```bash\n# a shell comment\n```\n#hashtag")


def test_sections_written_elsewhere_are_copied_in_leaving_the_rest(tmp_path):
    here, there = tmp_path / "BENCH.md", tmp_path / "gpu.md"
    here.write_text(FILE, encoding="utf-8")
    bench_sections.write_section(there, "bench_measure llama-3.1-8b cuda", "## 8B\n\nrows")
    bench_sections.write_section(there, "bench_workers", "## other workers")
    copied = bench_sections.copy_sections(there, here, ["bench_measure llama-3.1-8b cuda"])
    assert copied == ["bench_measure llama-3.1-8b cuda"]
    text = here.read_text(encoding="utf-8")
    assert text.startswith(FILE.rstrip("\n"))  # everything before kept byte for byte
    assert "cpu workers" in text and "other workers" not in text
    assert bench_sections.sections(text)["bench_measure llama-3.1-8b cuda"] == (
        "<!-- bench_measure llama-3.1-8b cuda: start -->\n\n## 8B\n\nrows\n\n"
        "<!-- bench_measure llama-3.1-8b cuda: end -->")
    with pytest.raises(KeyError, match="has no section 'nope'"):
        bench_sections.copy_sections(there, here, ["nope"])


def test_copy_refuses_a_folder_as_its_target(tmp_path, capsys):
    source = tmp_path / "gpu.md"
    bench_sections.write_section(source, "bench_workers", "rows")
    with pytest.raises(SystemExit) as info:
        bench_sections.main(["copy", str(source), str(tmp_path)])
    assert info.value.code == 2 and "is not a file" in capsys.readouterr().err
