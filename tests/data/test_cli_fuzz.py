"""Every hp-data command under generated arguments: one error boundary, nothing half-written.

Hypothesis draws command lines from values that broke hp-data before (negative, zero, huge,
NaN and infinite numbers; empty and odd strings; missing paths, directories, FIFOs) for every
flag of every command. Whatever it draws, the command exits 0, 1 or 2 with no traceback
(anything escaping the CLI's boundary is a bug), and a failed command leaves no new file at
the output paths. (Preprocess keeps its hidden work directory after a failure so that a
rerun resumes; index-cache lock files may stay; both are named in docs/reliability.md.)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hp_data.cli import main
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers.corpus import random_corpus, write_with_hp
from tests.helpers.corpus_files import english_records, write_jsonl

NUMBERS = ["0", "-1", "1", "2", "8", "nan", "inf", "-inf", "1e308", "0.5", "-0", "", " ", "x"]
NUMBERS += ["99999999999999999999", "10000000000", "4294967296", "1,2", "1,2,3,4", "1,,2"]
SPLITS = ["969,30,1", "1,0,0", "-1,2,3", ".", "1..2", "nan,1,1", "0,0,0", "", "1/2/3", "a"]


class Paths:
    """The things a path argument can name, made once per module."""

    def __init__(self, root: Path, tokenizer: Path) -> None:
        self.root = root
        self.dataset = str(root / "ds")
        write_with_hp(self.dataset, random_corpus(5, np.uint16, max_documents=30))
        self.corpus = str(write_jsonl(root / "c.jsonl", english_records(5, 20)))
        self.directory = str(root / "adir")
        os.mkdir(self.directory)
        self.fifo = str(root / "fifo")
        os.mkfifo(self.fifo)
        os.mkfifo(root / "fifods.idx")
        self.tokenizer = str(tokenizer)

    def inputs(self, usual: str | None = None) -> st.SearchStrategy[str]:
        """Any path, `usual` (the kind the flag takes) half of the time: runs get further."""
        missing = str(self.root / "missing")
        odd = ["", "-", " ", missing, self.directory, self.fifo, str(self.root / "fifods")]
        every = [self.dataset, self.corpus, self.tokenizer, *odd]
        return st.sampled_from(every + [usual] * len(every) if usual else every)


def _mostly(usual: str, values: list[str]) -> st.SearchStrategy[str]:
    return st.sampled_from([usual] * len(values) + values)


@pytest.fixture(scope="module")
def paths(tmp_path_factory, example_tokenizer) -> Paths:
    return Paths(tmp_path_factory.mktemp("fuzz"), example_tokenizer)


def _options(draw, flags: dict[str, st.SearchStrategy[str] | None]) -> list[str]:
    """Any subset of `flags` (None: a switch), in a drawn order."""
    chosen = draw(st.lists(st.sampled_from(sorted(flags)), unique=True, max_size=len(flags)))
    args: list[str] = []
    for flag in chosen:
        args += [flag] if flags[flag] is None else [flag, draw(flags[flag])]
    return args


@st.composite
def command_lines(draw, paths: Paths) -> tuple[list[str], Path]:
    """A command line, and the directory its outputs go to (fresh for each example)."""
    out = paths.root / f"out-{draw(st.integers(0, 10**9))}"
    numbers, inputs = st.sampled_from(NUMBERS), paths.inputs()
    command = draw(st.sampled_from(["inspect", "merge", "preprocess", "build-index", "plan"]))
    if command == "inspect":
        args = ["inspect", draw(paths.inputs(paths.dataset))] + _options(
            draw,
            {
                "--check": None,
                "--json": None,
                "--show": numbers,
                "--tokenizer": paths.inputs(paths.tokenizer),
                "--multimodal": None,
            },
        )
    elif command == "merge":
        targets = st.sampled_from([str(out / "m"), str(out / ""), str(out / ".idx"), paths.fifo])
        sources = st.lists(paths.inputs(paths.dataset), min_size=0, max_size=3)
        args = ["merge", draw(targets), *draw(sources)]
        args += _options(draw, {"--quiet": None, "--shards": None})
    elif command == "plan":
        args = ["plan", *draw(st.lists(paths.inputs(paths.corpus), min_size=1, max_size=2))]
        args += _options(
            draw,
            {
                "--units": numbers,
                "--unit-mb": numbers,
                "--num-shards": numbers,
                "--input-format": st.sampled_from(["jsonl", "parquet", "x"]),
                "--json": None,
            },
        )
    elif command == "preprocess":
        args = ["preprocess", *draw(st.lists(paths.inputs(paths.corpus), min_size=1, max_size=2))]
        args += ["--out", str(out / draw(st.sampled_from(["p", "", ".bin", "sub/p"])))]
        # Usually a real tokenizer and one worker: the run gets past its arguments, in-process.
        tokenizers = st.sampled_from([paths.tokenizer] * 4 + [paths.corpus, paths.directory])
        args += ["--tokenizer", draw(tokenizers)]
        args += ["--workers", draw(st.sampled_from(["1"] * 9 + ["0", "-2", "x"]))]
        args += _options(
            draw,
            {
                "--json-keys": st.sampled_from(["text", "title", "", "text text"]),
                "--append-eod": None,
                "--eod-token": st.sampled_from(["</s>", "", "<|nope|>"]),
                "--add-bos": None,
                "--dtype": st.sampled_from(["uint8", "uint16", "int64", "float32", ""]),
                "--skip-invalid": None,
                "--keep-empty": None,
                "--dedup": st.sampled_from(["exact", "fuzzy"]),
                "--input-format": st.sampled_from(["jsonl", "jsonl.zst", "parquet", "hf", "x"]),
                "--split": st.sampled_from(["train", "", "nope"]),
                "--chunk-mb": _mostly("0.001", NUMBERS),
                "--num-shards": _mostly("3", NUMBERS),
                "--shard-index": _mostly("1", NUMBERS),
                "--units": numbers,
                "--unit-mb": numbers,
                "--quiet": None,
                "--json": None,
            },
        )
    else:
        blends = st.sampled_from(
            [
                paths.dataset,
                f"0.5 {paths.dataset} 0.5 {paths.dataset}",
                f"1e308 {paths.dataset} 1e308 {paths.dataset}",
                f"nan {paths.dataset}",
                f"-1 {paths.dataset}",
                paths.dataset + ".idx",
            ]
        )
        args = ["build-index", "--data-path", draw(st.one_of(blends, blends, inputs))]
        args += ["--cache-dir", str(out / "cache"), "--seq-len", draw(_mostly("8", NUMBERS))]
        args += _options(
            draw,
            {
                "--seed": numbers,
                "--num-samples": _mostly("100,10,10", NUMBERS),
                "--split": st.sampled_from(SPLITS),
                "--no-extra-token": None,
                "--keep-last-partial-validation": None,
                "--json": None,
            },
        )
    return args, out


def _files(directory: Path) -> set[str]:
    if not directory.exists():
        return set()
    return {
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if path.is_file() and not path.name.endswith(".lock") and ".hp-preprocess" not in str(path)
    }


def _half_written(now: set[str], before: set[str]) -> set[str]:
    """Files a failed command added, but for complete index-cache sets: build-index may keep
    the sets of the splits it finished before the one that failed (valid cache entries)."""
    described = {name.rsplit("-", 1)[0] for name in now if name.endswith("-description.json")}
    return {name for name in now - before if name.rsplit("-", 1)[0] not in described}


@pytest.mark.slow
def test_every_command_exits_with_one_line_and_leaves_nothing_after_a_failure(paths):
    protected = {p: Path(p).read_bytes() for p in (paths.dataset + ".bin", paths.dataset + ".idx")}

    @settings(
        max_examples=200,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(command_lines(paths))
    def check(drawn: tuple[list[str], Path]) -> None:
        args, _ = drawn
        before = _files(paths.root)
        result = CliRunner().invoke(main, args)
        # Anything but SystemExit is an exception that escaped the CLI's error boundary.
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            args,
            result.exception,
        )
        assert result.exit_code in (0, 1, 2), (args, result.output)
        event(f"{args[0]} exit {result.exit_code}")  # --hypothesis-show-statistics
        assert "Traceback" not in result.output, (args, result.output)
        if result.exit_code != 0:
            assert not _half_written(_files(paths.root), before), (args, result.output)
            lines = [line for line in result.output.splitlines() if line.startswith("Error")]
            listing = "--check" in args and "problem" in result.output  # inspect's report
            assert len(lines) == 1 or listing, (args, result.output)

    check()
    for path, data in protected.items():  # inputs are never written, even as an output
        assert Path(path).read_bytes() == data or path.startswith(str(paths.root / "out"))
