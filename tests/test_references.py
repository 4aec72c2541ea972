"""The prose names code that exists: every dotted reference to this package's code or to
the benchmarks' (``headloc_bench``, benchmarks/headloc_bench) in the docs, the READMEs,
the top-level guides and the docstrings of both packages, of scripts/ and of the
benchmarks' entry points (benchmarks/*.py) resolves to a module and an attribute of it.

A *reference* is a code span (single or double backquotes, as Markdown and reST write
them), holding nothing but a dotted Python name (an optional trailing ``()`` allowed),
whose first component is ``lm_eval_headloc``, ``headloc_bench`` or the last component of
one of their modules or subpackages (``method``, ``runs``, ``confirm``, ``simulation``, …), so
``method.budget.budget_split``, ``runs.folder.CONFIG_SCHEMA`` and ``confirm.ROUND`` are
references and ``lm_eval.models`` or ``torch.nn.Module`` are not. Not references either:
a file name (``report.md``, ``types_file.py``: the last component is a file extension)
and the few names in ``NOT_CODE``, where a module's name is also a variable's.

A reference resolves when, after its longest prefix that names a module of either package
(``lm_eval_headloc.method.confirm``; a short form's prefix the last components of exactly
one module's name), the rest are attributes of that module, one after another (a class's
annotated fields count as its attributes, of their annotated type). Where a reference
fails, the prose is put right, never this test: it is what keeps a moved function from
leaving stale prose behind.

The docstrings are read from the sources (every bare string statement, so attribute
docstrings too, and the ``#:`` comments that document constants), for exact line numbers.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import io
import pkgutil
import re
import tokenize
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from helpers import bench_module

import lm_eval_headloc

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = lm_eval_headloc.__name__
#: The benchmarks' package (benchmarks/headloc_bench; imported here, its modules then
#: import by name).
BENCH = bench_module()

#: A code span holding only a dotted name: the same number of backquotes on each side.
_SPAN = re.compile(r"(?<!`)(`{1,2})([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?\1(?!`)")

#: Endings that make a dotted name a file's name (``verify.md``, ``cross.json``).
FILE_EXTENSIONS = frozenset({"py", "md", "json", "jsonl", "csv", "png", "npy", "npz", "toml",
                             "pth", "txt", "yaml", "yml", "html", "svg", "gguf", "pt",
                             "safetensors", "bin", "log", "sh", "cfg", "ini"})

#: Dotted names that start with a module's name and are not a path to this package's code
#: but an attribute path on a variable of that name: each maps to the class the variable
#: is, and is checked along that class's attributes and annotated fields instead.
NOT_CODE: dict[str, str] = {
    # The Hugging Face model an lm_eval model wraps, whose generate the benchmarks time.
    "model.generate": "transformers.GenerationMixin",
    # discovery.py walks the loaded model's modules.
    "model.named_modules": "torch.nn.Module",
    # report.pages.tie_words's argument.
    "ranking.facts.tied_with_above": "lm_eval_headloc.method.ranking.Ranking",
    # distributed.workers.start_workers's argument.
    "setup.spec.workers": "lm_eval_headloc.runs.setup.Setup",
}


def package_modules() -> list[str]:
    """Every module and subpackage of the package and of the benchmarks' package, by its
    full dotted name."""
    found = [PACKAGE, BENCH.__name__]
    for package in (lm_eval_headloc, BENCH):
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            found.append(info.name)
    return sorted(found)


MODULES = package_modules()
#: The first components a reference may have: the packages' and their modules' last names.
ROOTS = frozenset(name.rsplit(".", 1)[-1] for name in MODULES)


def dotted_names(text: str) -> Iterator[tuple[int, str]]:
    """(line index from 0, name) for every code span in text that holds a dotted name whose
    first component is the package's or one of its modules' and is no file's name."""
    for index, line in enumerate(text.splitlines()):
        for match in _SPAN.finditer(line):
            name = match.group(2)
            parts = name.split(".")
            if parts[0] in ROOTS and parts[-1] not in FILE_EXTENSIONS:
                yield index, name


def references(text: str) -> Iterator[tuple[int, str]]:
    """(line index from 0, reference) for every reference to the package's code in text."""
    return ((index, name) for index, name in dotted_names(text) if name not in NOT_CODE)


def _member(owner: object, name: str) -> object:
    """owner's attribute name; for a class, a field it annotates is its annotated type (a
    dataclass's field is documented as ``Class.field``, and ``Class.field.attribute``
    goes on along the field's type)."""
    if inspect.isclass(owner):
        try:
            hints = typing.get_type_hints(owner)
        except NameError:  # an annotation names what only a type checker imports
            hints = {}
        if name in hints:
            return hints[name]
    return getattr(owner, name)


def _modules_named(parts: list[str]) -> list[str]:
    """The package's modules whose dotted name is parts or ends with them."""
    if parts[0] in (PACKAGE, BENCH.__name__):
        name = ".".join(parts)
        return [name] if name in MODULES else []
    return [m for m in MODULES if m.split(".")[-len(parts):] == parts]


def problem(reference: str) -> str | None:
    """Why reference does not resolve, or None where it does."""
    parts = reference.split(".")
    for size in range(len(parts), 0, -1):
        modules = _modules_named(parts[:size])
        if len(modules) > 1:
            return f"ambiguous: {', '.join(modules)}"
        if not modules:
            continue
        target: object = importlib.import_module(modules[0])
        for depth, name in enumerate(parts[size:], start=size):
            try:
                target = _member(target, name)
            except AttributeError:
                return f"{modules[0]} has no {'.'.join(parts[size:depth + 1])}"
        return None
    return "no module of either package by that name"


def unresolved(sources: Iterable[tuple[str, int, str]]) -> tuple[list[str], int]:
    """The unresolved references of (label, first line number, text) sources, each as
    'label:line: reference (why)', and how many references were checked."""
    found: list[str] = []
    checked = 0
    for label, first_line, text in sources:
        for index, reference in references(text):
            checked += 1
            why = problem(reference)
            if why is not None:
                found.append(f"{label}:{first_line + index}: {reference} ({why})")
    return found, checked


@functools.cache
def markdown_sources() -> list[tuple[str, int, str]]:
    """The top-level pages (README.md, the guides), docs/*.md and benchmarks/README.md,
    each whole."""
    paths = [*sorted(ROOT.glob("*.md")), *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "benchmarks" / "README.md"]
    return [(str(p.relative_to(ROOT)), 1, p.read_text(encoding="utf-8")) for p in paths]


def python_prose(path: Path) -> list[tuple[str, int, str]]:
    """A Python file's docstrings (every bare string statement: module, class, function
    and attribute docstrings) and ``#:`` comments, with the line each starts on."""
    label = str(path.relative_to(ROOT))
    source = path.read_text(encoding="utf-8")
    found: list[tuple[str, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            # The source text, not the value: escapes cannot shift the line numbers.
            text = ast.get_source_segment(source, node.value)
            assert text is not None, (label, node.lineno)
            found.append((label, node.lineno, text))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.string.startswith("#:"):
            found.append((label, token.start[0], token.string))
    return found


@functools.cache
def docstring_sources() -> list[tuple[str, int, str]]:
    """The prose of every module of both packages (found as Python finds them), of the
    scripts in scripts/ and of the benchmarks' entry points (benchmarks/*.py)."""
    paths = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        paths.append(Path(spec.origin))
    paths += sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    return [source for path in paths for source in python_prose(path)]


def test_every_reference_to_the_package_resolves() -> None:
    problems, checked = unresolved([*markdown_sources(), *docstring_sources()])
    assert checked > 50, f"only {checked} references found: is the pattern still right?"
    assert not problems, (f"{len(problems)} of {checked} references do not resolve:\n"
                          + "\n".join(problems))


def test_the_checker_reports_a_bad_reference_and_passes_a_good_one() -> None:
    text = "\n".join([
        "Good: ``method.confirm.ROUND``, `budget.budget_split()`, ``lm_eval_headloc.method``,",
        "``runs.spec.RunSpec``, `lm_eval_headloc.method.rank.fit_rankings`.",
        "Bad: ``method.confirm.no_such_function``, and `confirm.budget_split` (moved).",
        "Not code: `heads.json`, `report.md`, `lm_eval.models`, `torch.nn.Module`, ``x.y``.",
        "Ambiguous: ``options.anything``; not a module: ``lm_eval_headloc.nowhere.f``.",
    ])
    problems, checked = unresolved([("made_up.md", 10, text)])
    assert checked == 9
    assert [p.split(" (")[0] for p in problems] == [
        "made_up.md:12: method.confirm.no_such_function",
        "made_up.md:12: confirm.budget_split",
        "made_up.md:14: options.anything",
        "made_up.md:14: lm_eval_headloc.nowhere.f",
    ]
    assert "ambiguous" in problems[2] and "common.options" in problems[2]


@pytest.mark.parametrize("name", sorted(NOT_CODE))
def test_each_exception_is_an_attribute_path_of_what_it_stands_for(name: str) -> None:
    """An exception is not this package's code (were it, it would be checked as such), the
    class it stands for has its attributes, and the prose still uses it."""
    assert problem(name) is not None, f"{name} resolves: it is code, not an exception"
    module, _, cls = NOT_CODE[name].rpartition(".")
    owner: object = getattr(importlib.import_module(module), cls)
    for part in name.split(".")[1:]:
        owner = _member(owner, part)
    used = [label for label, _, text in [*markdown_sources(), *docstring_sources()]
            if any(found == name for _, found in dotted_names(text))]
    assert used, f"no prose uses {name}: drop it from NOT_CODE"
