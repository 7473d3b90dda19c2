"""One shard of a run split over machines, and the merge of all shards into one dataset.

`hp-data preprocess ... --num-shards N --shard-index I --out PREFIX` processes group I of the
plan's units (plan.py) into `PREFIX.shard-0000I-of-0000N.bin/.idx` (per key, after Megatron's
key suffix) and, once those are committed, a manifest `PREFIX.shard-0000I-of-0000N.json`:
the run's configuration and plan fingerprints, the units it covers, the outputs and counts,
and the size and xxh3-128 of each file the shard wrote (`files`). With `--dedup exact` the
shard drops duplicates within itself and keeps the 128-bit hashes of what it wrote
(`.hashes`), so that the merge can keep first occurrences in global order.

`hp-data merge PREFIX --shards` checks every shard's manifest (all N present, one
configuration, one plan, units tiling it without gap or overlap) and every shard's files
against their recorded sizes and checksums before writing anything, then streams the shards
into `PREFIX.bin/.idx` in order. The result is byte-identical to a one-machine run of the
same inputs and options.
"""

from __future__ import annotations

import glob
import json
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hp_data.dataset import IndexedDataset
from hp_data.dedup import HashSet
from hp_data.errors import PreprocessError
from hp_data.format.blocks import file_record
from hp_data.format.builder import IndexedDatasetBuilder, finalize_together
from hp_data.format.commit import recover
from hp_data.format.header import bin_path, idx_path, metadata_path, prefix_of, sources_path
from hp_data.format.metadata import read_metadata, shared_metadata
from hp_data.fs import committing, write_bytes
from hp_data.plan import plan_fingerprint, shard_groups, shard_name
from hp_data.progress import Progress
from hp_data.provenance import Provenance, read_provenance
from hp_data.readers import WorkUnit
from hp_data.redact import redact_data

MANIFEST_VERSION = 2  # 2 added `files`, the size and checksum of each file of the shard
_NAME = re.compile(r"\.shard-(\d{5})-of-(\d{5})\.json$")
_FIELDS = {"version", "config", "plan", "units", "total_units", "outputs", "hashes", "summary"}


def _shard_files(outputs: dict[str, str], hashes: str | None) -> list[str]:
    """The paths of every file a shard wrote: each key's `.bin`, `.idx`, `.hp.json` and
    `.hp.sources` (when written), then its `.hashes`."""
    paths = []
    for prefix in outputs.values():
        paths += [bin_path(prefix), idx_path(prefix)]
        paths += [p for p in (metadata_path(prefix), sources_path(prefix)) if os.path.exists(p)]
    return [*paths, hashes] if hashes else paths


def _rerun(index: int, count: int) -> str:
    return f"rerun shard {index} (--num-shards {count} --shard-index {index}) and merge again"


def _size_problem(path: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with the size of the file at `path`, or None."""
    try:
        found = os.stat(path).st_size
    except FileNotFoundError:
        return f"{path}: missing, but its shard manifest records it"
    if found != expected["bytes"]:
        return (
            f"{path}: {found:,} bytes, but its shard manifest records {expected['bytes']:,} bytes"
        )
    return None


def _checksum_problem(
    path: str, expected: dict[str, Any], on_bytes: Callable[[int], None] | None = None
) -> str | None:
    """What is wrong with the content of the file at `path`, or None."""
    found = file_record(path, on_bytes)["xxh3_128"]
    if found != expected["xxh3_128"]:
        return (
            f"{path}: content differs from its shard manifest (xxh3-128 {found}, "
            f"recorded {expected['xxh3_128']})"
        )
    return None


@dataclass(frozen=True)
class ShardTask:
    """Shard `index` of `count` of a run writing `base` (its --out prefix)."""

    base: str
    index: int
    count: int
    units: range  # of the plan
    total_units: int
    plan: str  # the plan's fingerprint
    config: str  # the run's configuration fingerprint
    inputs: tuple[tuple[object, ...], ...] = ()  # its units' identities, for people to read

    @classmethod
    def of(
        cls, base: str, index: int, count: int, units: Sequence[WorkUnit], config: str
    ) -> ShardTask:
        group = shard_groups(units, count)[index]
        mine = tuple(tuple(units[u].identity) for u in group)
        plan = plan_fingerprint(units)
        return cls(prefix_of(base), index, count, group, len(units), plan, config, mine)

    @property
    def prefix(self) -> str:
        return shard_name(self.base, self.index, self.count)

    @property
    def manifest_path(self) -> str:
        return self.prefix + ".json"

    def name_for(self, output: str) -> str:
        return shard_name(output, self.index, self.count)

    def finished(self, outputs: dict[str, str]) -> dict[str, Any] | None:
        """The summary of this shard when an earlier run finished it as asked, else None."""
        try:
            with open(self.manifest_path, encoding="utf-8") as stream:
                manifest = json.load(stream)
        except (OSError, ValueError):
            return None
        same = (
            manifest.get("version") == MANIFEST_VERSION
            and manifest.get("config") == self.config
            and manifest.get("plan") == self.plan
            and manifest.get("units") == [self.units.start, self.units.stop]
            and _files_ok(manifest)
        )
        if not same:
            return None
        for prefix in outputs.values():
            recover(prefix)
        directory = os.path.dirname(self.manifest_path)
        for name, expected in manifest["files"].items():
            path = os.path.join(directory, name)
            problem = _size_problem(path, expected) or _checksum_problem(path, expected)
            if problem is not None:
                warnings.warn(f"{problem}; processing shard {self.index} again", stacklevel=2)
                return None
        return manifest["summary"]

    def commit(
        self, outputs: dict[str, str], unit_hashes: list[str] | None, summary: dict[str, Any]
    ) -> None:
        """Record the finished shard: its hashes (concatenated), then its manifest."""
        hashes = None
        if unit_hashes is not None:
            hashes = self.prefix + ".hashes"
            with committing(hashes) as out:
                for path in unit_hashes:
                    with open(path, "rb") as source:
                        while block := source.read(16 << 20):
                            out.write(block)
        manifest = {
            "version": MANIFEST_VERSION,
            "config": self.config,
            "plan": self.plan,
            "index": self.index,
            "count": self.count,
            "units": [self.units.start, self.units.stop],
            "total_units": self.total_units,
            # Path, format, size, mtime, and a part's byte or row-group range, of each unit.
            "inputs": [list(identity) for identity in self.inputs],
            "outputs": {key: os.path.basename(p) for key, p in outputs.items()},
            "hashes": os.path.basename(hashes) if hashes else None,
            # Read back once after the commit: the `.bin` was copied in the kernel
            # (copy_file_range), so its bytes never passed through here to be hashed.
            "files": {
                os.path.basename(path): file_record(path) for path in _shard_files(outputs, hashes)
            },
            "summary": summary,
        }
        # No credential is ever stored: a URL is named as `redact` prints it.
        write_bytes(self.manifest_path, json.dumps(redact_data(manifest), indent=1).encode())


def _files_ok(manifest: dict[str, Any]) -> bool:
    """Whether `files` records a size and checksum for each of the shard's datasets' files."""
    files, outputs = manifest.get("files"), manifest.get("outputs")
    if not isinstance(files, dict) or not isinstance(outputs, dict):
        return False
    if not all(isinstance(name, str) for name in outputs.values()):
        return False
    wanted = [name + suffix for name in outputs.values() for suffix in (".bin", ".idx")]
    return all(name in files for name in wanted) and all(
        isinstance(f, dict) and type(f.get("bytes")) is int and isinstance(f.get("xxh3_128"), str)
        for f in files.values()
    )


def _manifest_paths(base: str) -> list[str]:
    """The shard manifests of the run writing `base` (not the shards' `.hp.json`, which the
    same glob matches)."""
    found = glob.glob(glob.escape(base) + ".shard-*-of-*.json")
    return sorted(path for path in found if _NAME.fullmatch(path[len(base) :]))


def _run_of_output(base: str) -> str | None:
    """The prefix of the run (its --out or --output-prefix) that wrote shards of the
    dataset `base`, a key's `PREFIX_{key}_document`, when it is not `base` itself."""
    pattern = glob.escape(os.path.join(os.path.dirname(base), "")) + "*.shard-*-of-*.json"
    wanted = os.path.basename(base) + ".shard-"
    for path in sorted(glob.glob(pattern)):
        if not _NAME.search(path):
            continue
        try:
            with open(path, encoding="utf-8") as stream:
                outputs = json.load(stream).get("outputs")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(outputs, dict) and any(
            isinstance(name, str) and name.startswith(wanted) for name in outputs.values()
        ):
            return path[: _NAME.search(path).start()]
    return None


def _read_manifest(path: str, index: int, count: int) -> dict[str, Any]:
    """Shard `index` of `count`'s manifest at `path`, checked to be one hp-data wrote whole."""
    try:
        with open(path, encoding="utf-8") as stream:
            manifest = json.load(stream)
    except FileNotFoundError:
        raise PreprocessError(
            f"{path}: shard {index} of {count} is missing or not finished; run it "
            f"(--num-shards {count} --shard-index {index}) and merge again"
        ) from None
    except ValueError as exc:
        raise PreprocessError(f"{path}: unreadable shard manifest: {exc}") from None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    if version is not None and version != MANIFEST_VERSION:
        why = "not a version hp-data writes"
        if type(version) is int:
            older = "older ones record no checksums of the shard's files"
            why = older if version < MANIFEST_VERSION else "from a newer hp-data"
        raise PreprocessError(
            f"{path}: a shard manifest of version {version!r}, not {MANIFEST_VERSION} "
            f"({why}); " + _rerun(index, count)
        )
    if not isinstance(manifest, dict) or not manifest.keys() >= _FIELDS:
        raise PreprocessError(
            f"{path}: not a shard manifest of hp-data (needs {', '.join(sorted(_FIELDS))}); "
            + _rerun(index, count)
        )
    if not _files_ok(manifest):
        raise PreprocessError(
            f"{path}: its 'files' does not give the size and xxh3_128 of each of the "
            "shard's files; " + _rerun(index, count)
        )
    units = manifest["units"]
    if not (isinstance(units, list) and len(units) == 2 and all(type(u) is int for u in units)):
        raise PreprocessError(f"{path}: its 'units' is not [start, stop]; " + _rerun(index, count))
    manifest["path"] = path
    return manifest


def _manifests(base: str) -> list[dict[str, Any]]:
    """Every shard manifest of `base`, checked to form one complete run, in order."""
    found = _manifest_paths(base)
    if not found:
        run = _run_of_output(base)
        if run is not None:
            raise PreprocessError(
                f"{base}: a dataset of the sharded run {run}; merge with hp-data merge {run} "
                "--shards (it writes each key's dataset, this one too)"
            )
        raise PreprocessError(
            f"{base}: no finished shards ({os.path.basename(base)}.shard-*-of-*.json); "
            "a shard writes its manifest when it is done"
        )
    counts = {int(_NAME.search(path).group(2)) for path in found}
    if len(counts) != 1:
        raise PreprocessError(f"{base}: shards of runs split {sorted(counts)} ways; keep one")
    count = counts.pop()
    manifests = [
        _read_manifest(shard_name(base, index, count) + ".json", index, count)
        for index in range(count)
    ]
    first = manifests[0]
    covered = 0
    for manifest in manifests:
        for field, what in (("config", "options or tokenizer"), ("plan", "inputs")):
            if manifest.get(field) != first.get(field):
                raise PreprocessError(
                    f"{manifest['path']}: made with other {what} than {first['path']}; "
                    "rerun it with the same command line"
                )
        start, stop = manifest["units"]
        if start != covered:
            where = "leaves out" if start > covered else "repeats"
            raise PreprocessError(
                f"{manifest['path']}: covers units {start} to {stop}, but the shards before it "
                f"end at unit {covered}, so the merge {where} units {min(start, covered)} to "
                f"{max(start, covered)}; rerun it with the same command line"
            )
        covered = stop
    if covered != first["total_units"]:
        raise PreprocessError(
            f"{base}: the shards cover {covered} of {first['total_units']} units; rerun the last"
        )
    return manifests


def _verify(manifests: list[dict[str, Any]], directory: str, show_progress: bool) -> Progress:
    """Check every shard's files as its manifest records them: all sizes first (a truncated
    or swapped file is found without reading anything), then all checksums. Returns the
    merge's progress bar, one over this read and the copy that follows."""
    count = len(manifests)
    files = [
        (os.path.join(directory, name), expected, index)
        for index, manifest in enumerate(manifests)
        for name, expected in manifest["files"].items()
    ]
    for path, expected, index in files:
        if (problem := _size_problem(path, expected)) is not None:
            raise PreprocessError(f"{problem}; {_rerun(index, count)}")
    copied = sum(
        m["files"][name + ".bin"]["bytes"] for m in manifests for name in m["outputs"].values()
    )
    progress = Progress(
        sum(f["bytes"] for _, f, _ in files) + copied, "merge", enabled=show_progress
    )
    for path, expected, index in files:
        if (problem := _checksum_problem(path, expected, progress.add_bytes)) is not None:
            raise PreprocessError(f"{problem}; {_rerun(index, count)}")
    return progress


def merge_shards(out_prefix: str, show_progress: bool = False) -> dict[str, Any]:
    """Merge the finished shards of `out_prefix` into its outputs; returns what was written.

    Everything is checked before anything is written. With `--dedup exact` shards, a
    document is kept only where its hash first occurs in shard order, as one machine does."""
    base = prefix_of(out_prefix)
    manifests = _manifests(base)
    directory = os.path.dirname(base)
    keys = list(manifests[0]["outputs"])
    dedup = manifests[0]["hashes"] is not None
    sources = [{key: os.path.join(directory, m["outputs"][key]) for key in keys} for m in manifests]
    for shard in sources:
        for prefix in shard.values():
            recover(prefix)
    progress = _verify(manifests, directory, show_progress)
    with IndexedDataset(sources[0][keys[0]], validate=False) as first:
        dtype = first.dtype
    # A shard's output is its one-machine counterpart's name plus `.shard-I-of-N`.
    finals = {key: sources[0][key][: -len(".shard-00000-of-00000")] for key in keys}
    seen = HashSet() if dedup else None
    builders = [
        IndexedDatasetBuilder(
            finals[key], dtype, metadata=shared_metadata([shard[key] for shard in sources])
        )
        for key in keys
    ]
    documents = duplicates = 0
    largest: dict[str, list[int]] = {key: [] for key in keys}  # per shard: its kept ids' largest
    provenance: dict[str, list[Provenance]] = {key: [] for key in keys}
    try:
        for manifest, shard in zip(manifests, sources, strict=True):
            keep = None
            if seen is not None:
                hashes = np.fromfile(os.path.join(directory, manifest["hashes"]), np.uint64)
                keep = seen.add_new(hashes.reshape(-1, 2))
                duplicates += int((~keep).sum())
            for key in keys:  # a duplicate across shards: a skipped record of its unit
                found = read_provenance(shard[key])
                if found is not None:
                    provenance[key].append(found if keep is None else found.drop(keep))
            for key, builder in zip(keys, builders, strict=True):
                kept = builder.add_index(shard[key], on_bytes=progress.add_bytes, keep=keep)
                if keep is None or keep.all():
                    kept = (read_metadata(shard[key]) or {}).get("max_token_id")
                largest[key].append(-1 if kept is None else kept)
        documents = builders[0].document_count
        for key, builder in zip(keys, builders, strict=True):
            if len(provenance[key]) == len(sources):  # shards of an older hp-data have none
                builder.sources = Provenance.concatenate(provenance[key])
            if builder.metadata is not None and "max_token_id" in builder.metadata:
                # Documents dropped across shards may have held the largest id: the kept
                # tokens', as a one-machine run records it.
                found = max(largest[key], default=-1)
                builder.metadata = {
                    **builder.metadata,
                    "max_token_id": None if found < 0 else found,
                }
    except BaseException:
        for builder in builders:
            builder.abort()
        raise
    finalize_together(builders)
    progress.close()
    return {
        "outputs": finals,
        "shards": len(manifests),
        "documents": documents,
        "duplicates_across_shards": duplicates,
    }
