"""BENCH.md is written by several benchmarks, each owning its part of the file.

``bench_measure.py`` on the CPU owns the head of the file (everything outside marked
sections); every other writer (``bench_measure.py --device cuda``, ``bench_workers.py`` per
device) owns one section between ``<!-- NAME: start -->`` and ``<!-- NAME: end -->``. A
writer replaces only what it owns, so a GPU run on a borrowed machine and a CPU run here
never erase each other's numbers.
"""

from __future__ import annotations

import re
from pathlib import Path

_SECTION = re.compile(r"<!-- (?P<name>[^:>]+): start -->.*?<!-- (?P=name): end -->", re.S)


def section_name(benchmark: str, device: str) -> str:
    """The marker name of one benchmark's section on one device (CPU keeps the old name)."""
    return benchmark if device == "cpu" else f"{benchmark} {device}"


def marked(name: str, body: str) -> str:
    return f"<!-- {name}: start -->\n\n{body.strip()}\n\n<!-- {name}: end -->"


def sections(text: str) -> dict[str, str]:
    """Every marked section of ``text`` by name, markers included, in file order."""
    return {m["name"]: m[0] for m in _SECTION.finditer(text)}


def demote(markdown: str) -> str:
    """One heading level down (``#`` -> ``##``), so a whole report fits under the head."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" + line if not fenced and re.match(r"#+ ", line) else line)
    return "\n".join(out)


def write_section(path: Path, name: str, body: str) -> None:
    """Replace section ``name`` of ``path`` (or append it); the rest stays byte for byte."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    block = marked(name, body)
    old = sections(text).get(name)
    if old is not None:
        text = text.replace(old, block, 1)
    else:
        text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text, encoding="utf-8")


def write_head(path: Path, head: str) -> None:
    """Replace everything outside the marked sections with ``head``; keep the sections."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    kept = list(sections(text).values())
    path.write_text("\n\n".join([head.rstrip("\n"), *kept]) + "\n", encoding="utf-8")
