"""Inputs found: paths, globs, directories, URLs and HF datasets into whole work units, each
input once, in the documented order (an input named again is read once, with a warning)."""

from __future__ import annotations

import glob
import os
import time
import warnings
from collections.abc import Sequence
from stat import S_ISREG

from hp_data.errors import PreprocessError
from hp_data.readers.units import (
    STDIN,
    WorkUnit,
)
from hp_data.redact import redact
from hp_data.remote import (
    Pin,
    canonical_url,
    expand,
    identify,
    is_url,
    local_path,
)

SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".json.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".json.zst": "jsonl.zst",
    ".jsonl.zstd": "jsonl.zst",
    ".parquet": "parquet",
}

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf-saved", "hf")

HF_SAVED_MARKERS = ("state.json", "dataset_dict.json")

# hp's metadata beside a dataset (format/metadata.py): JSON by name, never a corpus, so a
# directory or glob that also holds outputs does not read it.
HP_METADATA = ".hp.json"


def _files_in(directory: str) -> list[str]:
    names = sorted(os.listdir(directory))
    return [os.path.join(directory, n) for n in names if _corpus_format(n) is not None]


def _corpus_format(name: str) -> str | None:
    """The format of a file a directory holds, or None when it is no corpus."""
    return None if name.endswith(HP_METADATA) else suffix_format(name)


def suffix_format(name: str) -> str | None:
    lowered = name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if lowered.endswith(suffix):
            return SUFFIXES[suffix]
    return None


def _tree_size(path: str) -> tuple[int, int]:
    size = mtime = 0
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            size += stat.st_size
            mtime = max(mtime, stat.st_mtime_ns)
    return size, mtime


def _same_input(path: str) -> tuple[object, ...]:
    """What two names of one input share: standard input; a URL as fsspec normalises it; a
    local file or directory (a `file://` URL too, `discover`) by
    device and inode, so `./a`, a symbolic link and a hard link are `a`."""
    if path == STDIN:
        return (STDIN,)
    if is_url(path):
        return ("url", canonical_url(path))  # not redacted: `?key=a` and `?key=b` differ
    stat = os.stat(path)
    return ("local", stat.st_dev, stat.st_ino)


def _read_once(named: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The paths that the `named` inputs (each with the paths it stands for) stand for, each
    input once, where it first occurs: a corpus read twice would train on its documents twice.
    One warning for each name that stood for an input already read."""
    first: dict[tuple[object, ...], tuple[str, str]] = {}  # input: (its path, its name)
    for spec, paths in named:
        again = []
        for path in paths:
            key = _same_input(path)
            if key in first:
                again.append((path, *first[key]))
            else:
                first[key] = (path, spec)
        if not again:
            continue
        if paths == [spec]:  # named outright, not a glob or directory
            _, earlier, its_name = again[0]
            if earlier == spec:
                what = "named more than once" if its_name == spec else f"already in {its_name}"
            else:
                what = f"the same input as {earlier}"
        else:
            shown = ", ".join(path for path, _, _ in again[:3]) + (", ..." if again[3:] else "")
            inputs = "input" if len(again) == 1 else "inputs"
            what = f"holds {len(again)} {inputs} named before ({shown})"
        # Redacted here, each URL on its own: the line's redaction would take the ':' after a
        # secret query value for part of the value.
        warnings.warn(f"{redact(spec)}: {redact(what)}; read once, where first named", stacklevel=3)
    return [path for path, _ in first.values()]


def discover(specs: Sequence[str], input_format: str | None = None) -> list[WorkUnit]:
    """The inputs for paths, globs and directories, each one whole unit, in the documented
    order (`plan.plan_units` cuts them into smaller units).

    A directory holding a saved HF dataset (`state.json` or `dataset_dict.json`) is one
    input; with `input_format="hf"` a directory is loaded with `datasets.load_dataset` (local
    files only); any other directory stands for its corpus files.
    """
    if input_format is not None and input_format not in FORMATS:
        raise PreprocessError(f"unknown --input-format {input_format!r}; use one of {FORMATS}")
    named = _named_paths(specs, input_format)
    sources = [_whole_unit(path, input_format) for path in _read_once(named)]
    if not sources:
        raise PreprocessError("no input files given")
    return sources


def _named_paths(specs: Sequence[str], input_format: str | None) -> list[tuple[str, list[str]]]:
    """Each input named, with the paths it stands for: a URL's or glob's matches, a
    directory's corpus files (not a saved HF dataset's), or the path itself."""
    named: list[tuple[str, list[str]]] = []  # each input named, with the paths it stands for
    for name in specs:
        spec = local_path(name)
        paths: list[str] = []
        named.append((name, paths))
        if is_url(spec):
            found = expand(spec, _corpus_format)
            paths.extend(url for url in found if url == spec or not url.endswith(HP_METADATA))
            continue
        if glob.has_magic(spec) and not os.path.exists(spec):
            matches = [m for m in sorted(glob.glob(spec)) if not m.endswith(HP_METADATA)]
            if not matches:
                raise PreprocessError(f"{spec}: pattern matches no files")
        else:
            matches = [spec]
        for match in matches:
            if match == STDIN:
                paths.append(match)
                continue
            if not os.path.exists(match):
                raise PreprocessError(f"{match}: no such file or directory")
            is_dataset_dir = input_format in ("hf", "hf-saved") or any(
                os.path.exists(os.path.join(match, m)) for m in HF_SAVED_MARKERS
            )
            if os.path.isdir(match) and not is_dataset_dir:
                found = _files_in(match)
                if not found:
                    raise PreprocessError(
                        f"{match}: directory holds no corpus files ({', '.join(SUFFIXES)})"
                    )
                paths.extend(found)
            else:
                paths.append(match)
    return named


def _whole_unit(path: str, input_format: str | None) -> WorkUnit:
    """One input as a whole work unit, with its format, size and pin."""
    if path == STDIN:
        fmt = input_format or "jsonl"
        if fmt not in ("jsonl", "jsonl.gz"):
            raise PreprocessError(
                f"standard input (-) can be read as jsonl or jsonl.gz, not {fmt}; "
                "decompress it into the pipe (e.g. zstd -dc FILE | hp-data preprocess -)"
            )
        return WorkUnit(path, fmt, 0, time.time_ns())
    if is_url(path):
        fmt = input_format or suffix_format(path.split("?", 1)[0])  # a presigned query
        if fmt is None or fmt.startswith("hf"):
            raise PreprocessError(
                f"{path}: a URL is read as a jsonl, jsonl.gz, jsonl.zst or parquet file; "
                "name its format with --input-format"
            )
        pin = identify(path)
        return WorkUnit(path, fmt, pin.size, pin.number, pin=pin)
    if os.path.isdir(path):
        if input_format == "hf":
            fmt = "hf"
        elif any(os.path.exists(os.path.join(path, m)) for m in HF_SAVED_MARKERS):
            fmt = "hf-saved"
        else:
            raise PreprocessError(
                f"{path}: not a saved HF dataset (no state.json); "
                f"use --input-format hf to load it with datasets.load_dataset"
            )
        size, mtime = _tree_size(path)
        pin = None
    else:
        fmt = input_format or suffix_format(path)
        if input_format is not None and input_format.startswith("hf"):
            raise PreprocessError(
                f"{path}: --input-format {input_format} reads a directory (an HF dataset), "
                f"and this is a file; use --input-format jsonl or parquet, or none"
            )
        if fmt is None or fmt.startswith("hf"):
            raise PreprocessError(
                f"{path}: cannot tell the format from the name; name it with --input-format"
            )
        stat = os.stat(path)
        if not S_ISREG(stat.st_mode):
            raise PreprocessError(
                f"{path}: not a regular file (a pipe or a device has no size to split or "
                f"resume by); give its contents on standard input as -"
            )
        size, mtime, pin = stat.st_size, stat.st_mtime_ns, Pin.of_stat(stat)
    return WorkUnit(path, fmt, size, mtime, pin=pin)
