"""benchmarks/bench_store.py: benchmarks/ holds the committed run folders as archives; every
file comes back byte for byte, a pack with nothing new changes nothing, and an unpacked
copy is never overwritten where it holds work the archives lack."""

from __future__ import annotations

import io
import lzma
import tarfile
from pathlib import Path, PurePosixPath

import pytest
from helpers import raises_naming

from headloc_bench import bench_store, refit_committed


@pytest.fixture(scope="module")
def store():
    return bench_store


#: A small tree as benchmarks/ lays out its run folders, with bytes no text editor keeps
#: (no final newline, CRLF, NUL, high bytes), and what the archives leave out.
FILES = {
    "exhaustive/config.json": b'{"command": "greedy"}',
    "exhaustive/heads.json": b'{"effect": -0.13787178800814684}\r\n',
    "exhaustive/heatmap.png": b"\x89PNG\r\n\x1a\n\x00\xff",  # kept: not a run's of SPLIT
    "exhaustive/types.json": b"{}\n",
    "recovery-runs/results.json": b"[]",
    "recovery-runs/t1/stratified-p0.1/seed0/design_matrix.npy": bytes(range(256)) * 3,
    "recovery-runs/t1/stratified-p0.1/seed0/measurements.jsonl": b'{"key": "baseline"}\n',
    "recovery-runs/t2/joint/prior.json": b'{"tasks": {}}\n',
    "neurons/t1/neurons-p1/prior.json": b"0.1234567890123456789\n" * 100,
}
KEPT_OUT = {
    "recovery-runs/t1/stratified-p0.1/seed0/heatmap.png": b"png",
    "recovery-runs/t1/stratified-p0.1/seed0/.lock": b"",
    "recovery-runs/t1/stratified-p0.1/seed0/.heads.json.1234.partial": b"half",
    "recovery-runs/t1/types.json": b"{}",
    "neurons/t1/neurons-p1/heatmap.png": b"png",
}


def write(tree: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(data)
    return tree


def read(tree: Path) -> dict[str, bytes]:
    return {p.relative_to(tree).as_posix(): p.read_bytes()
            for p in sorted(tree.rglob("*")) if p.is_file() and p.name != ".unpacked.json"}


def test_a_pack_unpacks_to_the_same_bytes_and_leaves_out_what_git_ignored(store, tmp_path):
    tree = write(tmp_path / "tree", {**FILES, **KEPT_OUT})
    written = store.pack(tree, tmp_path / "store")
    assert written == ["exhaustive", "neurons/t1", "recovery-runs/results.json",
                       "recovery-runs/t1", "recovery-runs/t2"]
    assert sorted(store.archives(tmp_path / "store")) == written
    assert (tmp_path / "store" / "recovery-runs" / "t1.tar.xz").is_file()
    copy = store.unpack(tmp_path / "copy", tmp_path / "store")
    assert read(copy) == FILES


def test_packing_is_deterministic_and_a_repack_of_nothing_new_writes_nothing(store, tmp_path):
    tree = write(tmp_path / "tree", FILES)
    store.pack(tree, tmp_path / "a")
    archive = tmp_path / "a" / "recovery-runs" / "t1.tar.xz"
    before = archive.read_bytes()
    for path in tree.rglob("*"):  # other times and permissions: the same archive
        path.chmod(0o755 if path.is_dir() else 0o600)
    store.pack(tree, tmp_path / "b")
    assert (tmp_path / "b" / "recovery-runs" / "t1.tar.xz").read_bytes() == before
    stat = archive.stat()
    assert store.pack(tree, tmp_path / "a") == []
    assert archive.stat().st_mtime_ns == stat.st_mtime_ns  # not even rewritten
    # One changed byte rewrites its own part's archive and no other.
    name = "recovery-runs/t1/stratified-p0.1/seed0/measurements.jsonl"
    (tree / name).write_bytes(FILES[name].replace(b"baseline", b"baselinf"))
    assert store.pack(tree, tmp_path / "a") == ["recovery-runs/t1"]
    assert store.read_archive(archive, "recovery-runs/t1")[name] == (tree / name).read_bytes()


def test_an_archive_holds_only_plain_files_of_its_own_part(store, tmp_path):
    def archive(name: str, kind: bytes = tarfile.REGTYPE) -> Path:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
            tar.addfile(info, io.BytesIO(b""))
        path = tmp_path / "x.tar.xz"
        path.write_bytes(lzma.compress(buffer.getvalue()))
        return path

    for name, kind in (("recovery-runs/t2/a.json", tarfile.REGTYPE),
                       ("/etc/passwd", tarfile.REGTYPE),
                       ("recovery-runs/t1/../../../x", tarfile.REGTYPE),
                       ("recovery-runs/t1/link", tarfile.SYMTYPE)):
        with raises_naming(store.StoreError, repr(name), "recovery-runs/t1"):
            store.read_archive(archive(name, kind), "recovery-runs/t1")


def test_sync_takes_a_newer_archive_but_never_overwrites_work(store, tmp_path):
    source, work, archives = tmp_path / "source", tmp_path / "work", tmp_path / "store"
    store.pack(write(source, FILES), archives)
    assert store.sync(work, archives) == sorted(store.archives(archives))
    assert read(work) == FILES
    assert store.sync(work, archives) == []
    # Work in the unpacked copy (a resumed run) is kept while its archive is unchanged.
    ours = "recovery-runs/t1/stratified-p0.1/seed0/measurements.jsonl"
    (work / ours).write_bytes(FILES[ours] + b'{"key": "mask-0000"}\n')
    (work / "recovery-runs/t2/joint/new.json").write_bytes(b"{}")
    assert store.sync(work, archives) == []
    assert list(store.status(work, archives)) == [
        "recovery-runs/t1: work/ changed (pack stores it)",
        "recovery-runs/t2: work/ changed (pack stores it)"]
    # A newer archive (a pull) replaces a part the copy did not change...
    theirs = "neurons/t1/neurons-p1/prior.json"
    write(source, {theirs: b"0.5\n"})
    store.pack(source, archives)
    assert store.sync(work, archives) == ["neurons/t1"]
    assert (work / theirs).read_bytes() == b"0.5\n"
    # ...and refuses one it did, until told which copy to keep.
    write(source, {ours: b"theirs\n"})
    store.pack(source, archives)
    with raises_naming(store.StoreError, str(work), str(archives), "recovery-runs/t1"):
        store.sync(work, archives)
    assert (work / ours).read_bytes().endswith(b'"mask-0000"}\n')
    assert store.sync(work, archives, discard=["recovery-runs/t1"]) == ["recovery-runs/t1"]
    assert (work / ours).read_bytes() == b"theirs\n"
    assert store.pack(work, archives) == ["recovery-runs/t2"]  # the new file, stored
    assert list(store.status(work, archives)) == []


def test_a_pack_never_drops_a_stored_file_unless_told(store, tmp_path):
    tree, archives = write(tmp_path / "tree", FILES), tmp_path / "store"
    store.pack(tree, archives)
    gone = "recovery-runs/t2/joint/prior.json"
    (tree / gone).unlink()
    (tree / "recovery-runs/t2/joint/other.json").write_bytes(b"{}")
    (tree / "exhaustive/heads.json").write_bytes(b"changed")
    before = {part: path.read_bytes() for part, path in store.archives(archives).items()}
    with raises_naming(store.StoreError, "tree/", "t2.tar.xz", gone):
        store.pack(tree, archives)
    assert {p: path.read_bytes() for p, path in store.archives(archives).items()} == before
    assert store.pack(tree, archives, drop=True) == ["exhaustive", "recovery-runs/t2"]
    assert gone not in store.read_archive(archives / "recovery-runs" / "t2.tar.xz")
    # A part deleted from the unpacked copy keeps its archive, and comes back.
    for path in sorted((tree / "neurons").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    assert "neurons/t1" in store.archives(archives) and store.pack(tree, archives) == []
    assert store.sync(tree, archives) == ["neurons/t1"]
    assert read(tree)["neurons/t1/neurons-p1/prior.json"] == FILES[
        "neurons/t1/neurons-p1/prior.json"]


def test_unpack_fills_only_an_empty_folder(store, tmp_path):
    store.pack(write(tmp_path / "tree", FILES), tmp_path / "store")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("a user's file")
    with raises_naming(store.StoreError, str(tmp_path / "full")):
        store.unpack(tmp_path / "full", tmp_path / "store")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["mine.txt"]


def test_the_committed_store_holds_each_file_once_and_repacks_unchanged(store, tmp_path,
                                                                       committed_benchmarks):
    """Every committed archive comes back as the files it was packed from: packing the
    unpacked copy again finds nothing to write (the same content, archive by archive)."""
    archives = store.archives()
    assert {"exhaustive", "exhaustive-heldout", "recovery-runs/headloc_ioi",
            "neurons/headloc_arith"} <= set(archives)
    copy = tmp_path / "store"
    for path in archives.values():
        (copy / path.relative_to(store.STORE)).parent.mkdir(parents=True, exist_ok=True)
        (copy / path.relative_to(store.STORE)).write_bytes(path.read_bytes())
    assert store.pack(committed_benchmarks, copy) == []
    names = [n for part, path in archives.items() for n in store.read_archive(path, part)]
    assert len(names) == len(set(names)) == len(store.tree_files(committed_benchmarks))
    assert not any(store.kept_out(PurePosixPath(n)) for n in names)


def test_refit_committed_checks_and_rewrites_the_archived_runs(store, tmp_path, monkeypatch,
                                                              committed_benchmarks, capsys):
    """benchmarks/refit_committed.py on a store of one committed run whose report.md is not
    what today's refit writes: --check names it and fails; without --check the archive is
    rewritten with the refit's text, after which --check passes."""
    name = "recovery-runs/headloc_induction/stratified-p0.1-atp-path/m54-seed0"
    source = committed_benchmarks / name
    files = {f"{name}/{p.name}": p.read_bytes() for p in source.iterdir() if p.is_file()}
    good = files[f"{name}/report.md"]
    files[f"{name}/report.md"] = b"an older report\n"
    archives = tmp_path / "store"
    store.pack(write(tmp_path / "tree", files), archives)
    archive = archives / "recovery-runs" / "headloc_induction.tar.xz"
    monkeypatch.setattr(refit_committed, "STORE", archives)
    monkeypatch.setattr(refit_committed, "committed_folders",
                        lambda tree: sorted(tree.rglob("config.json")))  # not git's others
    assert refit_committed.main(["--check"]) == 1
    assert capsys.readouterr().out == f"benchmarks/{name}: report.md\n"
    assert store.read_archive(archive)[f"{name}/report.md"] == b"an older report\n"
    assert refit_committed.main([]) == 0
    assert store.read_archive(archive) == {**files, f"{name}/report.md": good}
    assert refit_committed.main(["--check"]) == 0
