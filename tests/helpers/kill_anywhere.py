"""SIGKILL a job of hp-data at its N-th filesystem step, for every N, and report what is left.

Run as `python -m tests.helpers.kill_anywhere JOB DIR TOKENIZER`; prints one JSON line per
kill point. For N = 1, 2, ... a forked child patches the calls that change or sync the
filesystem (rename, replace, remove, rmtree, mkdir, symlink, fsync) to kill itself with
SIGKILL just before the N-th one, and runs the job. The parent then records what the final
paths hold — raw on disk, and as hp opens them (which finishes an interrupted commit) — reruns
the job to completion, compares the bytes with an uninterrupted run, and restores the
starting state. It stops at the first N the job survives. The parent tokenizes with one
worker, which keeps `tokenizers` single-threaded, so forking it is safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

KEYS = ("text", "title")
PATCHED = [
    (os, "replace"),
    (os, "rename"),
    (os, "remove"),
    (os, "unlink"),
    (os, "mkdir"),
    (os, "symlink"),
    (os, "fsync"),
    (shutil, "rmtree"),
]


def _kill_before(step: int, extra: Sequence[tuple[object, str]] = ()) -> None:
    calls = 0
    for module, name in [*PATCHED, *extra]:
        original = getattr(module, name)

        def patched(*args, _original=original, **kwargs):
            nonlocal calls
            calls += 1
            if calls == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return _original(*args, **kwargs)

        setattr(module, name, patched)


def _in_child(
    job: Callable[[], None], step: int | None, extra: Sequence[tuple[object, str]] = ()
) -> bool:
    """Run `job` in a forked child; True when it was killed. `extra` (module, name) pairs
    are kill points besides PATCHED."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if step is not None:
                _kill_before(step, extra)
            job()
        except BaseException as exc:  # reported by the exit code
            print(f"job failed: {exc!r}", file=sys.stderr)
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return True
    if os.WEXITSTATUS(status) != 0:
        raise SystemExit(f"the job failed at step {step}")
    return False


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


class Outputs:
    """The files of the final prefixes, classified against the old and the new bytes."""

    def __init__(self, prefixes: list[Path]) -> None:
        self.prefixes = prefixes

    suffixes = (".bin", ".idx", ".hp.json")

    def files(self) -> list[Path]:
        """Each dataset's files: `.bin`, `.idx` and hp's `.hp.json` (maybe absent)."""
        return [p.with_name(p.name + s) for p in self.prefixes for s in self.suffixes]

    def snapshot(self) -> list[bytes | None]:
        return [_read(f) for f in self.files()]

    def classify(self, old: list, new: list) -> str:
        now = self.snapshot()
        if now == new:
            return "new"
        if now == old:
            return "old" if any(b is not None for b in old) else "nothing"
        return "mixed"

    def journal(self) -> bool:
        return any(p.with_name(f".{p.name}.hp-commit").exists() for p in self.prefixes)

    def open_all(self) -> None:
        from hp_data import IndexedDataset, IndexedDatasetError

        for prefix in self.prefixes:
            with contextlib.suppress(IndexedDatasetError):  # no dataset there (yet)
                IndexedDataset(str(prefix)).close()

    def restore(self, old: list) -> None:
        for path, data in zip(self.files(), old, strict=True):
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(data)


def _preprocess_job(root: Path, tokenizer: str) -> tuple[Callable[[], None], Outputs]:
    from hp_data.fast_bpe import probe_texts
    from hp_data.pipeline import PreprocessOptions, preprocess

    probe_texts()  # drawn once here: each forked run (about 180) inherits them

    for name, count in (("a", 30), ("b", 40)):
        with open(root / f"{name}.jsonl", "w") as stream:
            for i in range(count):
                record = {"text": f"{name} document {i} " * (i % 5 + 1), "title": f"{name}{i}"}
                stream.write(json.dumps(record) + "\n")
    # tokenizers' own engine: choosing tiktoken (converting and proving it) writes nothing
    # but costs 0.2 s of each of the ~180 runs; the kill points are the same.
    options = PreprocessOptions(
        json_keys=KEYS, workers=1, show_progress=False, tokenizer_engine="hf"
    )
    out = root / "out" / "corpus"

    def old() -> None:
        preprocess([str(root / "a.jsonl")], str(out), tokenizer, options)

    assert not _in_child(old, None)
    inputs = [str(root / "b.jsonl")]  # one shard: its steps and the final ones, not twice
    prefixes = [out.with_name(f"corpus_{key}_document") for key in KEYS]
    return lambda: preprocess(inputs, str(out), tokenizer, options) and None, Outputs(prefixes)


def _merge_job(
    root: Path, tokenizer: str, over_old: bool = True
) -> tuple[Callable[[], None], Outputs]:
    from hp_data import IndexedDatasetBuilder
    from hp_data.merge import merge_datasets

    rng = np.random.default_rng(0)
    for name in ("x", "y", "z"):
        # x's record goes with the old output; the new one, of unrecorded y and z, has none.
        metadata = {"schema": 1, "tokenizer": {"xxh3_128": "0" * 32}} if name == "x" else None
        with IndexedDatasetBuilder(str(root / name), np.uint16, metadata=metadata) as builder:
            for _ in range(50):
                builder.add_item(rng.integers(0, 1000, rng.integers(1, 40)))
                builder.end_document()
    out = root / "out" / "merged"
    if over_old:
        assert not _in_child(lambda: merge_datasets(str(out), [str(root / "x")]) and None, None)
    inputs = [str(root / "y"), str(root / "z")]
    return lambda: merge_datasets(str(out), inputs) and None, Outputs([out])


def _merge_sources_job(root: Path, tokenizer: str) -> tuple[Callable[[], None], Outputs]:
    """A merge of preprocessed datasets over an older merge of others: the new `.hp.sources`
    (provenance.py) must replace the old one in the same commit as the `.idx` it describes."""
    from hp_data.merge import merge_datasets
    from hp_data.pipeline import PreprocessOptions, preprocess

    options = PreprocessOptions(workers=1, show_progress=False, tokenizer_engine="hf")
    for name, count in (("x", 20), ("y", 30), ("z", 25)):
        with open(root / f"{name}.jsonl", "w") as stream:
            for i in range(count):
                stream.write(json.dumps({"text": f"{name} document {i} " * (i % 4 + 1)}) + "\n")
        preprocess([str(root / f"{name}.jsonl")], str(root / name), tokenizer, options)
    out = root / "out" / "merged"
    assert not _in_child(lambda: merge_datasets(str(out), [str(root / "x")]) and None, None)
    inputs = [str(root / "y"), str(root / "z")]

    class SourcesOutputs(Outputs):
        suffixes = (".bin", ".idx", ".hp.json", ".hp.sources")

        def open_all(self) -> None:
            from hp_data.provenance import read_provenance

            super().open_all()
            with contextlib.suppress(FileNotFoundError):  # raises when it does not match
                read_provenance(str(out))

    return lambda: merge_datasets(str(out), inputs) and None, SourcesOutputs([out])


def _build_index_job(root: Path, tokenizer: str) -> tuple[Callable[[], None], Outputs]:
    from hp_data import IndexedDatasetBuilder
    from hp_data.gpt import GPTDataset, GPTDatasetConfig

    rng = np.random.default_rng(1)
    with IndexedDatasetBuilder(str(root / "corpus"), np.uint16) as builder:
        for _ in range(200):
            builder.add_item(rng.integers(0, 1000, rng.integers(1, 40)))
            builder.end_document()
    cache = root / "out" / "cache"
    config = GPTDatasetConfig(seq_length=16, split="90,10,0", cache_dir=str(cache))

    def job() -> None:
        for split in ("train", "valid"):
            GPTDataset(str(root / "corpus"), split, None, config)

    class CacheOutputs(Outputs):
        """The cache's files as a whole: a fresh load must give the uninterrupted arrays."""

        def files(self) -> list[Path]:
            return sorted(cache.glob("*.npy")) + sorted(cache.glob("*.json"))

        def snapshot(self) -> list[bytes | None]:
            return [f.read_bytes() for f in self.files()]

        def journal(self) -> bool:
            return False

        def open_all(self) -> None:
            pass

        def restore(self, old: list) -> None:
            shutil.rmtree(cache, ignore_errors=True)

    return job, CacheOutputs([])


JOBS = {
    "preprocess": _preprocess_job,
    "merge": _merge_job,
    "merge-fresh": lambda root, tokenizer: _merge_job(root, tokenizer, over_old=False),
    "build-index": _build_index_job,
    "merge-sources": _merge_sources_job,
}


def main(job_name: str, directory: str, tokenizer: str) -> None:
    root = Path(directory)
    root.joinpath("out").mkdir(parents=True, exist_ok=True)
    job, outputs = JOBS[job_name](root, tokenizer)
    old = outputs.snapshot()
    job()  # here, not in a child: every later child starts with the imports and kernels warm
    new = outputs.snapshot()
    assert new != old and all(
        b is not None for b, f in zip(new, outputs.files(), strict=True) if f.suffix != ".json"
    )
    outputs.restore(old)
    for step in range(1, 1000):
        killed = _in_child(job, step)
        raw = outputs.classify(old, new)
        journal = outputs.journal()
        outputs.open_all()  # as hp would: finishes a commit the kill interrupted
        opened = outputs.classify(old, new)
        _in_child(job, None)
        rerun = outputs.classify(old, new)
        leftovers = sorted(
            name
            for name in os.listdir(root / "out")
            if name.startswith(".") and not name.endswith(".lock")
        )
        report = {"step": step, "killed": killed, "raw": raw, "journal": journal}
        report |= {"opened": opened, "rerun": rerun, "leftovers": leftovers}
        print(json.dumps(report), flush=True)
        if not killed:
            return
        outputs.restore(old)
        for name in os.listdir(root / "out"):  # a new run starts from the old state only
            if name.startswith("."):
                path = root / "out" / name
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


if __name__ == "__main__":
    main(*sys.argv[1:])
