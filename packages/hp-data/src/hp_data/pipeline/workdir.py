"""The resumable work directory beside a preprocess output: finished units, their hashes
and skipped lines, and the manifest that a rerun with the same configuration takes up."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import xxhash

from hp_data.errors import PreprocessError
from hp_data.format.header import bin_path, idx_path
from hp_data.fs import write_json
from hp_data.pipeline.options import PreprocessOptions
from hp_data.pipeline.worker import _WorkerSpec
from hp_data.readers.units import WorkUnit
from hp_data.redact import redact_data
from hp_data.remote import same_file

MANIFEST_VERSION = 1


@dataclass
class _UnitStats:
    records: int = 0
    written: int = 0
    empty: int = 0
    duplicates: int = 0
    invalid: dict[str, int] = field(default_factory=dict)
    invalid_examples: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    max_token_id: dict[str, int] = field(default_factory=dict)  # per key with any token
    lines: int = 0
    verified: int = 0  # documents whose fast-engine ids were checked against tokenizers


class _WorkDir:
    """The hidden directory beside the output: finished units, their hashes, a manifest (its
    `shard000000_KEY` names and `"shards"` list are a stored format, read by a resumed run)."""

    def __init__(self, out_prefix: str, config: str) -> None:
        directory, name = os.path.split(os.path.abspath(out_prefix))
        self.path = os.path.join(directory, f".{name}.hp-preprocess")
        os.makedirs(self.path, exist_ok=True)
        self._lock = open(os.path.join(self.path, "lock"), "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PreprocessError(
                f"{out_prefix}: another hp-data preprocess is writing this output"
            ) from None
        self.config = config
        self.manifest = self._read_manifest()

    def _read_manifest(self) -> dict[str, Any]:
        fresh = {"version": MANIFEST_VERSION, "config": self.config, "shards": []}
        try:
            with open(os.path.join(self.path, "manifest.json"), encoding="utf-8") as stream:
                manifest = json.load(stream)
        except (OSError, ValueError):
            return fresh
        if manifest.get("version") != MANIFEST_VERSION or manifest.get("config") != self.config:
            return fresh
        return manifest

    def unit_prefix(self, index: int, key: str) -> str:
        return os.path.join(self.path, f"shard{index:06d}_{key}")

    def hashes_path(self, index: int) -> str:
        """Raw (n, 2) uint64 hashes of the records a finished unit kept."""
        return os.path.join(self.path, f"shard{index:06d}.hashes")

    def skipped_path(self, index: int) -> str:
        """Raw int64 line offsets of a finished unit's records that made no document, then
        a uint8 reason each (provenance.py)."""
        return os.path.join(self.path, f"shard{index:06d}.skipped")

    def reusable(self, units: list[WorkUnit], keys: tuple[str, ...]) -> int:
        """How many leading units a previous run finished with these same inputs."""
        done = 0
        for unit, record in zip(units, self.manifest["shards"], strict=False):
            complete = os.path.exists(self.skipped_path(done)) and all(
                os.path.exists(path(self.unit_prefix(done, k)))
                for k in keys
                for path in (bin_path, idx_path)
            )
            same = record["identity"] == unit.identity and same_file(record, unit.pin)
            if not same or not unit.reusable or not complete:
                break
            done += 1
        self.manifest["shards"] = self.manifest["shards"][:done]
        return done

    def record(self, unit: WorkUnit, stats: _UnitStats) -> None:
        inode = unit.pin and unit.pin.inode_number  # a local file's: see `same_file`
        self.manifest["shards"].append(
            {"identity": unit.identity, "inode": inode, "stats": stats.__dict__}
        )
        target = os.path.join(self.path, "manifest.json")
        write_json(target, redact_data(self.manifest))  # no credential is ever stored

    def remove(self) -> None:
        # The manifest goes first: a kill inside rmtree leaves nothing a rerun would reuse.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, "manifest.json"))
        self._lock.close()
        shutil.rmtree(self.path, ignore_errors=True)

    def release(self) -> None:
        self._lock.close()


def _config_hash(tokenizer_hash: str, spec: _WorkerSpec, options: PreprocessOptions) -> str:
    """Everything besides the inputs that changes the output; a mismatch starts over."""
    described = {
        "tokenizer": tokenizer_hash,
        "keys": spec.keys,
        "dtype": spec.dtype,
        "bos": spec.bos,
        "eod": spec.eod,
        "keep_empty": spec.keep_empty,
        "dedup": spec.dedup,
        "skip_invalid": not spec.stop_at_invalid,
        "input_format": options.input_format,
        "split": options.hf_split,  # the stored key stays
        "max_chars": spec.max_chars,
    }
    return xxhash.xxh3_128_hexdigest(json.dumps(described, sort_keys=True).encode())
