"""The run folder every ``headloc-harness`` subcommand writes, reads and resumes.

``config.json``       arguments, the example subset, package versions
``measurements.jsonl`` one line per measurement, flushed to disk before the next starts
``design_matrix.npy``  the masks (locate), generated up front from the seed
results files          written by the subcommand (heads.json, heads.csv, report.md, …)

A rerun of the same command continues where the last one stopped; a folder made with
different defining arguments is refused (``--force`` starts over).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["RunFolder", "RunFolderError", "package_versions"]


class RunFolderError(ValueError):
    """A run folder that does not fit the command (a user mistake, reported in one line)."""


def package_versions() -> dict[str, str]:
    names = ["lm-eval-headloc", "lm_eval", "torch", "transformers", "peft", "numpy",
             "scikit-learn", "gguf"]
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


class RunFolder:
    """A folder of one run; ``identity`` holds the arguments that define its results."""

    CONFIG = "config.json"
    MEASUREMENTS = "measurements.jsonl"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def file(self, name: str) -> Path:
        return self.path / name

    def exists(self) -> bool:
        return self.file(self.CONFIG).is_file()

    def read_config(self) -> dict[str, Any]:
        if not self.exists():
            raise RunFolderError(f"{self.path} is not a run folder (no {self.CONFIG})")
        return json.loads(self.file(self.CONFIG).read_text())

    def start(self, command: str, identity: Mapping[str, Any], settings: Mapping[str, Any],
              force: bool = False) -> bool:
        """Create the folder, or check that it belongs to this command. True if resuming."""
        identity = json.loads(json.dumps(identity))  # as it will read back from disk
        if self.exists() and not force:
            config = self.read_config()
            if config.get("command") != command:
                raise RunFolderError(
                    f"{self.path} holds a '{config.get('command')}' run, not '{command}'; "
                    "use another --out or --force to start over")
            differing = sorted(k for k in set(identity) | set(config.get("identity", {}))
                               if identity.get(k) != config["identity"].get(k))
            if differing:
                key = differing[0]
                raise RunFolderError(
                    f"{self.path} was made with {key}={config['identity'].get(key)!r}, "
                    f"not {identity.get(key)!r}; use another --out or --force to start over")
            config["settings"] = dict(settings)
            self._write_config(config)
            return True
        if force and self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._write_config({
            "command": command, "identity": identity, "settings": dict(settings),
            "versions": package_versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
        return False

    def update_config(self, **fields: Any) -> None:
        config = self.read_config()
        config.update(fields)
        self._write_config(config)

    def _write_config(self, config: Mapping[str, Any]) -> None:
        self.write_text(self.CONFIG, json.dumps(config, indent=2) + "\n")

    def write_text(self, name: str, text: str) -> None:
        """Write atomically: a reader never sees half a file."""
        target = self.file(name)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(text)
        os.replace(partial, target)

    def write_json(self, name: str, data: Any) -> None:
        self.write_text(name, json.dumps(data, indent=2) + "\n")

    # --- measurements -------------------------------------------------------------

    def measurements(self) -> list[dict[str, Any]]:
        """Every complete measurement line; a line cut short by a kill is dropped."""
        path = self.file(self.MEASUREMENTS)
        if not path.is_file():
            return []
        records, good_bytes = [], 0
        with path.open("rb") as handle:
            for raw in handle:
                try:
                    records.append(json.loads(raw))
                except json.JSONDecodeError:
                    break
                if not raw.endswith(b"\n"):
                    records.pop()
                    break
                good_bytes += len(raw)
        if good_bytes != path.stat().st_size:  # drop the torn tail so appends stay valid
            with path.open("r+b") as handle:
                handle.truncate(good_bytes)
        return records

    def append_measurement(self, record: Mapping[str, Any]) -> None:
        """Append one line and force it to disk before the next measurement starts."""
        with self.file(self.MEASUREMENTS).open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
