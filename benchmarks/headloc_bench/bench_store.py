"""benchmarks/ keeps the committed run folders packed: a few xz-compressed tar archives
instead of about 2,300 files (92 MB as files, about 7 MB packed). Scripts read and write
the folders in an unpacked copy, ``bench-work/`` (ignored by git), never in the archives.

    python benchmarks/bench_store.py unpack       # bench-work/ up to date with benchmarks/
    python benchmarks/bench_store.py pack         # benchmarks/ up to date with bench-work/
    python benchmarks/bench_store.py unpack --to DIR   # a fresh copy elsewhere (DIR must be empty)
    python benchmarks/bench_store.py status       # which parts differ, and which way

One archive per *part*: ``exhaustive``, ``exhaustive-heldout``, and each entry of
``recovery-runs/`` and ``neurons/`` (a task's folder, ``recovery-runs/results.json``):
``benchmarks/<part>.tar.xz``, its members named as in the tree (``recovery-runs/
headloc_ioi/joint/config.json``), so unpacking every archive into one folder lays the
folders out as they were. A part per task keeps a new run from rewriting more than its
task's archive (git stores every version of an archive whole).

Nothing is lost or changed: an archive holds each file's bytes exactly (``benchmarks/tests/
test_bench_store.py``), and the files are what they were when they lay in benchmarks/
as folders, the ranking files included (a refit on another CPU moves the last bits of a
fitted effect, so they are stored, not regenerated). Kept out of the archives, as
.gitignore kept them out of git: hidden files (locks, partial writes), the heatmaps of
``recovery-runs/`` and ``neurons/``, and ``recovery-runs/``'s copied ``types.json``.

Packing is deterministic (sorted members, no times or owners; xz preset 9) and an archive
is rewritten only when the files it holds changed, compared by content, so a pack with
nothing new changes nothing in git. ``bench-work/.unpacked.json`` records what each part
was unpacked from; ``unpack`` replaces a part in bench-work/ only when the archive
changed since (a checkout, a pull) and the part did not, and refuses when both did
(``pack`` keeps bench-work/'s, ``unpack --discard PART`` takes the archive's).
The scripts that make or render the benchmarks (``bench_recovery.py``,
``bench_neurons.py``, ``budget_split.py``) unpack before they start and pack when they
end; ``refit_committed.py`` and the tests unpack into a temporary folder of their own.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import sys
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path, PurePosixPath

from headloc_bench import ROOT

#: The archives (and README.md), as git tracks them.
STORE = ROOT / "benchmarks"
#: Where scripts read and write the run folders: the store unpacked (ignored by git).
WORK_TREE = ROOT / "bench-work"
SUFFIX = ".tar.xz"
#: Folders of the tree whose entries are a part each (one per task); any other entry of
#: the tree's top level is a part of its own.
SPLIT = ("recovery-runs", "neurons")
#: What ``unpack`` remembers of each part, in the unpacked tree.
STATE = ".unpacked.json"
PRESET = 9


class StoreError(RuntimeError):
    """A part that bench-work/ and the store both changed, or an archive not as packed."""


def kept_out(name: PurePosixPath) -> bool:
    """Whether a file of the tree (its path relative to the tree) stays out of the
    archives, as .gitignore kept it out of git before the folders were packed."""
    top = name.parts[0]
    return (any(part.startswith(".") for part in name.parts)
            or (top in SPLIT and name.suffix == ".png")
            or (top == "recovery-runs" and name.name == "types.json"))


def part_of(name: PurePosixPath) -> str:
    """The part a file of the tree belongs to: ``recovery-runs/headloc_ioi``, ``exhaustive``."""
    depth = 2 if name.parts[0] in SPLIT and len(name.parts) > 1 else 1
    return "/".join(name.parts[:depth])


def archive_path(part: str, store: Path = STORE) -> Path:
    return store / (part + SUFFIX)


def archives(store: Path = STORE) -> dict[str, Path]:
    """Every archive of the store, by part."""
    found = {}
    for path in sorted(store.rglob("*" + SUFFIX)):
        found[path.relative_to(store).as_posix()[:-len(SUFFIX)]] = path
    return found


def tree_files(tree: Path, part: str | None = None) -> dict[str, Path]:
    """The files of the unpacked ``tree`` that the archives hold (of one part, or all),
    by their name in the tree, sorted."""
    start = tree / part if part else tree
    if start.is_file():
        candidates: Iterable[Path] = [start]
    elif start.is_dir():
        candidates = (p for p in start.rglob("*") if p.is_file() and not p.is_symlink())
    else:
        return {}
    files = {}
    for path in candidates:
        name = PurePosixPath(path.relative_to(tree).as_posix())
        if not kept_out(name):
            files[str(name)] = path
    return dict(sorted(files.items()))


def digest(files: dict[str, bytes]) -> str:
    """A part's content: every file's name and bytes (not how a tar or xz encodes them)."""
    sha = hashlib.sha256()
    for name in sorted(files):
        sha.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return sha.hexdigest()


def pack_bytes(files: dict[str, bytes]) -> bytes:
    """``files`` (name in the tree -> bytes) as a tar.xz, the same bytes every time: sorted
    members, plain files, no times, owners or permissions of the machine."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return lzma.compress(buffer.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                         preset=PRESET)


def read_archive(path: Path, part: str | None = None) -> dict[str, bytes]:
    """An archive's files, name -> bytes. Only plain files, named relative, inside
    ``part`` when given (an archive is opened by ``tarfile`` alone: nothing is extracted
    by name where the name says)."""
    files = {}
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(path.read_bytes())), mode="r:") as tar:
        for member in tar.getmembers():
            name = PurePosixPath(member.name)
            if not member.isfile() or name.is_absolute() or ".." in name.parts or (
                    part is not None and part_of(name) != part):
                raise StoreError(f"{path}: {member.name!r} is not a file of {part or 'the tree'}")
            extracted = tar.extractfile(member)
            assert extracted is not None
            files[str(name)] = extracted.read()
    return files


def write_files(tree: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = tree / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_state(tree: Path) -> dict[str, dict[str, str]]:
    path = tree / STATE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _write_state(tree: Path, state: dict[str, dict[str, str]]) -> None:
    tree.mkdir(parents=True, exist_ok=True)
    _write_atomically(tree / STATE, json.dumps(dict(sorted(state.items())), indent=1).encode())


def _tree_content(tree: Path, part: str) -> dict[str, bytes]:
    return {name: path.read_bytes() for name, path in tree_files(tree, part).items()}


def unpack(dest: Path, store: Path = STORE) -> Path:
    """Every archive of ``store`` into ``dest``, which must be empty or new: a fresh copy of
    the committed folders (to read, or to refit and ``pack`` back). Returns ``dest``."""
    if dest.exists() and any(dest.iterdir()):
        raise StoreError(f"{dest} is not empty")
    state = {}
    for part, path in archives(store).items():
        data = path.read_bytes()
        files = read_archive(path, part)
        write_files(dest, files)
        state[part] = {"archive": _sha(data), "content": digest(files)}
    _write_state(dest, state)
    return dest


def sync(tree: Path = WORK_TREE, store: Path = STORE, discard: Sequence[str] = ()
         ) -> list[str]:
    """Bring the unpacked ``tree`` up to date with the store; the parts replaced. A part is
    unpacked where the tree lacks it, or where its archive changed since it was unpacked
    (a checkout or a pull) and the tree's copy did not (its work is in the archive). Where
    both changed, ``StoreError``, unless the part is in ``discard`` (the tree's copy is
    then replaced). Parts the archives lack (new runs) are left alone."""
    state = _read_state(tree)
    replaced, conflicts = [], []
    for part, path in archives(store).items():
        data = path.read_bytes()
        record = state.get(part)
        if (record is not None and record["archive"] == _sha(data) and part not in discard
                and tree_files(tree, part)):
            continue  # as unpacked, or newer work of the tree's
        files = read_archive(path, part)
        ours = _tree_content(tree, part)
        if ours and part not in discard and digest(ours) != digest(files) and (
                record is None or digest(ours) != record["content"]):
            conflicts.append(part)
            continue
        for name in set(ours) - set(files):
            (tree / name).unlink()
        write_files(tree, {name: b for name, b in files.items() if ours.get(name) != b})
        state[part] = {"archive": _sha(data), "content": digest(files)}
        if ours != files:
            replaced.append(part)
    _write_state(tree, state)
    if conflicts:
        raise StoreError(
            f"{tree} and {store} both changed {', '.join(conflicts)} since it was unpacked: "
            "keep the unpacked copy with `python benchmarks/bench_store.py pack`, or take the "
            "archive's with `python benchmarks/bench_store.py unpack --discard PART`")
    return replaced


def tree_parts(tree: Path) -> list[str]:
    """The parts the unpacked ``tree`` holds files of."""
    return sorted({part_of(PurePosixPath(name)) for name in tree_files(tree)})


def pack(tree: Path = WORK_TREE, store: Path = STORE, drop: bool = False) -> list[str]:
    """Store every part of ``tree`` whose files differ from its archive's (or that has
    none); the parts written. Nothing stored is deleted unless ``drop``: a part the tree
    lacks keeps its archive, and a part that lacks a file its archive holds is refused
    (``StoreError``) before any archive is written."""
    state = _read_state(tree)
    todo = []
    for part in tree_parts(tree):
        files = _tree_content(tree, part)
        path = archive_path(part, store)
        stored = read_archive(path, part) if path.is_file() else {}
        if stored and digest(stored) == digest(files):
            state[part] = {"archive": _sha(path.read_bytes()), "content": digest(files)}
            continue
        lost = sorted(set(stored) - set(files))
        if lost and not drop:
            raise StoreError(
                f"{tree.name}/ lacks {len(lost)} file(s) that {path.name} holds ({lost[0]}"
                f"{', ...' if len(lost) > 1 else ''}): copy them back from a fresh copy "
                "(`python benchmarks/bench_store.py unpack --to DIR`), or drop them from the "
                "archive with `python benchmarks/bench_store.py pack --drop`")
        todo.append((part, files, path))
    written = []
    for part, files, path in todo:
        data = pack_bytes(files)
        _write_atomically(path, data)
        state[part] = {"archive": _sha(data), "content": digest(files)}
        written.append(part)
    _write_state(tree, state)
    return written


def status(tree: Path = WORK_TREE, store: Path = STORE) -> Iterator[str]:
    """One line per part where the tree and the store differ."""
    state = _read_state(tree)
    stored = archives(store)
    for part in sorted(set(stored) | set(tree_parts(tree))):
        ours = _tree_content(tree, part)
        if part not in stored:
            yield f"{part}: only in {tree.name}/ (pack stores it)"
            continue
        theirs = read_archive(stored[part], part)
        if not ours:
            yield f"{part}: not unpacked"
        elif digest(ours) != digest(theirs):
            record = state.get(part)
            archive_changed = record is None or record["archive"] != _sha(
                stored[part].read_bytes())
            tree_changed = record is None or record["content"] != digest(ours)
            which = ("both changed" if archive_changed and tree_changed else
                     "the archive changed (unpack takes it)" if archive_changed else
                     f"{tree.name}/ changed (pack stores it)")
            yield f"{part}: {which}"


def work_tree() -> Path:
    """``WORK_TREE`` up to date with the store (``sync``): where the scripts' runs live.
    Exits (status 1) where bench-work/ and the store both changed a part."""
    try:
        replaced = sync()
    except StoreError as error:
        raise SystemExit(f"bench_store: {error}") from None
    if replaced:
        print(f"unpacked {', '.join(replaced)} into {WORK_TREE.relative_to(ROOT)}/",
              file=sys.stderr)
    return WORK_TREE


def store_work() -> None:
    """``pack`` the work tree, saying which archives changed. Exits (status 1) where a
    part lost a stored file: the work stays in bench-work/, for ``pack`` once resolved."""
    try:
        written = pack()
    except StoreError as error:
        raise SystemExit(f"bench_store: not packed: {error}") from None
    if written:
        print(f"packed {', '.join(written)} into {STORE.relative_to(ROOT)}/", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("unpack", "pack", "status"))
    parser.add_argument("--to", type=Path, default=None,
                        help="unpack a fresh copy into this (empty or new) folder")
    parser.add_argument("--discard", action="append", default=[], metavar="PART",
                        help="unpack: replace this part's unpacked copy even where it changed")
    parser.add_argument("--drop", action="store_true",
                        help="pack: store a part without the files bench-work/ no longer has")
    args = parser.parse_args(argv)
    try:
        if args.action == "unpack" and args.to is not None:
            unpack(args.to)
            print(f"unpacked {STORE.relative_to(ROOT)}/ into {args.to}")
        elif args.action == "unpack":
            replaced = sync(discard=args.discard)
            print(f"{WORK_TREE.relative_to(ROOT)}/: {len(replaced)} part(s) unpacked"
                  + (f" ({', '.join(replaced)})" if replaced else ""))
        elif args.action == "pack":
            written = pack(drop=args.drop)
            print(f"{STORE.relative_to(ROOT)}/: {len(written)} archive(s) written"
                  + (f" ({', '.join(written)})" if written else ""))
        else:
            lines = list(status())
            print("\n".join(lines) if lines else "bench-work/ and benchmarks/ hold the same")
            return 1 if lines else 0
    except StoreError as error:
        print(f"bench_store: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

