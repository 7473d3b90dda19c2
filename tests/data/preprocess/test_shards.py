"""A run split into N shards (one per machine) merges into exactly a one-machine run's bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner
from hp_data import PreprocessError
from hp_data.cli import main
from hp_data.shards import merge_shards

from tests.helpers.corpus_files import english_records, write_jsonl, write_parquet
from tests.helpers.run import HP_DATA, read_bytes, run_preprocess

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, example_corpus) -> list[Path]:
    """One large JSONL file (cut in byte ranges), two small ones, and a Parquet file of
    several row groups; records repeat across files, for --dedup."""
    root = tmp_path_factory.mktemp("corpus")
    big = root / "a-big.jsonl"
    big.write_bytes(example_corpus.read_bytes()[:600_000].rsplit(b"\n", 1)[0] + b"\n")
    records = english_records(7, 300, keys=("text", "title"))
    small = [write_jsonl(root / f"b{i}.jsonl", records[i * 100 : i * 100 + 150]) for i in (0, 1)]
    table = write_parquet(root / "c.parquet", records, row_group_size=40)
    return [big, *small, table]


def _sharded(inputs, out, tokenizer, count: int, **options) -> None:
    for index in range(count):
        run_preprocess(inputs, out, tokenizer, num_shards=count, shard_index=index, **options)
    merge_shards(str(out))


CASES = {
    "jsonl ranges": ([0], {"unit_bytes": 60_000}),
    "several files, eod, dedup": (
        [0, 1, 2],
        {"unit_bytes": 100_000, "append_eod": True, "dedup": "exact"},
    ),
    "parquet row groups": ([3], {"unit_bytes": 3_000}),
    "two keys, everything": (
        [1, 2, 3],
        {
            "unit_bytes": 2_000,
            "json_keys": ("text", "title"),
            "dedup": "exact",
            "add_bos": True,
            "bos_token": "<|endoftext|>",
        },
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("count", [1, 3])
def test_shards_merge_to_the_one_machine_bytes(tmp_path, corpus, example_tokenizer, case, count):
    picked, options = CASES[case]
    inputs = [corpus[i] for i in picked]
    one = run_preprocess(inputs, tmp_path / "one", example_tokenizer, **options)
    _sharded(inputs, tmp_path / "many", example_tokenizer, count, **options)
    for key, prefix in one.outputs.items():
        name = Path(prefix).name.replace("one", "many", 1)
        assert read_bytes(tmp_path / name, metadata=True) == read_bytes(prefix, metadata=True), key


def test_a_finished_shard_is_not_redone_and_merge_checks_every_shard(
    tmp_path, corpus, example_tokenizer
):
    inputs, out = corpus[:3], tmp_path / "x"
    options = {"num_shards": 3, "unit_bytes": 100_000, "append_eod": True}
    run_preprocess(inputs, out, example_tokenizer, shard_index=0, **options)
    with pytest.raises(PreprocessError, match=r"x.shard-00001-of-00003.json: shard 1 of 3 is"):
        merge_shards(str(out))
    run_preprocess(inputs, out, example_tokenizer, shard_index=1, **options)
    shard = Path(f"{out}.shard-00001-of-00003.bin")
    written = shard.stat().st_mtime_ns
    again = run_preprocess(inputs, out, example_tokenizer, shard_index=1, **options)
    assert again.resumed_shards == again.shards and shard.stat().st_mtime_ns == written
    # A shard made with other options (no --append-eod) does not belong to this run.
    run_preprocess(
        inputs, out, example_tokenizer, shard_index=2, **{**options, "append_eod": False}
    )
    with pytest.raises(PreprocessError, match=r"x.shard-00002-of-00003.json: made with other op"):
        merge_shards(str(out))
    assert not Path(f"{out}.bin").exists()
    # Nor one made from other inputs.
    run_preprocess(inputs[:2], out, example_tokenizer, shard_index=2, **options)
    with pytest.raises(PreprocessError, match=r"x.shard-00002-of-00003.json: made with other in"):
        merge_shards(str(out))
    Path(f"{out}.shard-00002-of-00003.json").write_text('{"version": 2}')
    with pytest.raises(PreprocessError, match=r"x.shard-00002-of-00003.json: not a shard manif"):
        merge_shards(str(out))
    run_preprocess(inputs, out, example_tokenizer, shard_index=2, **options)
    merge_shards(str(out))
    run_preprocess(inputs, tmp_path / "one", example_tokenizer, append_eod=True)
    assert read_bytes(out, metadata=True) == read_bytes(tmp_path / "one", metadata=True)


def test_the_plan_cuts_at_line_starts_and_is_printable(tmp_path, corpus):
    big = corpus[0]
    result = CliRunner().invoke(
        main, ["plan", str(big), "--unit-mb", "0.05", "--num-shards", "3", "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    data = big.read_bytes()
    line_starts = [0] + [i + 1 for i, byte in enumerate(data) if byte == 10][:-1]
    cut = int(0.05 * (1 << 20))
    # An independent cut: the first line start at or after each multiple of the unit size.
    expected = sorted(
        {
            min(s for s in line_starts if s >= k)
            for k in range(0, len(data), cut)
            if any(s >= k for s in line_starts)
        }
    )
    assert [u["start"] for u in plan["units"]] == expected
    assert [u["end"] for u in plan["units"]] == [*expected[1:], len(data)]
    owners = [u["shard"] for u in plan["units"]]
    assert owners == sorted(owners) and set(owners) == {0, 1, 2}
    again = CliRunner().invoke(
        main, ["plan", str(big), "--unit-mb", "0.05", "--num-shards", "3", "--json"]
    )
    assert again.output == result.output  # deterministic


def test_a_line_number_inside_a_later_unit_counts_from_the_file_start(tmp_path):
    lines = [json.dumps({"text": f"line {i}"}) + "\n" for i in range(400)]
    lines[350] = '{"text": 5}\n'
    path = tmp_path / "c.jsonl"
    path.write_text("".join(lines))
    with pytest.raises(PreprocessError, match=r"c.jsonl:351: 'text' must be a string"):
        run_preprocess(
            [path],
            tmp_path / "x",
            ROOT / "examples" / "tokenizer.json",
            unit_bytes=1000,
            num_shards=4,
            shard_index=3,
        )


def test_the_slurm_array_scripts_give_the_one_machine_bytes(tmp_path, corpus, example_tokenizer):
    run_preprocess(corpus[:3], tmp_path / "one", example_tokenizer, append_eod=True)
    env = {
        **os.environ,
        "PATH": f"{Path(HP_DATA).parent}{os.pathsep}{os.environ['PATH']}",
        "HP_INPUTS": " ".join(str(p) for p in corpus[:3]),
        "HP_OUT": str(tmp_path / "many"),
        "HP_TOKENIZER": str(example_tokenizer),
        "HP_OPTIONS": "--append-eod --workers 1 --unit-mb 0.1",
        "SLURM_ARRAY_TASK_COUNT": "3",
    }
    for task in range(3):
        subprocess.run(
            ["bash", str(ROOT / "examples" / "slurm" / "preprocess.sbatch")],
            env={**env, "SLURM_ARRAY_TASK_ID": str(task)},
            check=True,
            capture_output=True,
            timeout=120,
        )
    subprocess.run(
        ["bash", str(ROOT / "examples" / "slurm" / "merge.sbatch")],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert read_bytes(tmp_path / "many", metadata=True) == read_bytes(
        tmp_path / "one", metadata=True
    )


# -- merge --shards checks each shard's files against the sizes and checksums of its manifest

SHARDED = {"num_shards": 3, "unit_bytes": 20_000, "append_eod": True, "dedup": "exact"}
USER_FILES = {
    "notes.txt": b"my notes\n",
    "sub/kept.jsonl": b'{"text": "mine"}\n',
    "x2.bin": b"not hp's",  # named like another dataset's files
    "x2.idx": b"not hp's either",
    "x.txt": b"named like the prefix",
}


def _write_user_files(directory: Path) -> None:
    for name, data in USER_FILES.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)


def _assert_user_files_intact(directory: Path) -> None:
    for name, data in USER_FILES.items():
        assert (directory / name).read_bytes() == data, name


def _shard(directory: Path, index: int, suffix: str) -> Path:
    return directory / f"x.shard-{index:05d}-of-00003{suffix}"


@pytest.fixture(scope="module")
def finished_shards(tmp_path_factory, corpus, example_tokenizer) -> Path:
    """Three finished shards of the two small files (with dedup, so `.hashes` too) and a
    one-machine run of the same command, `one`, to compare with."""
    directory = tmp_path_factory.mktemp("shards")
    for index in range(3):
        run_preprocess(
            corpus[1:3], directory / "x", example_tokenizer, shard_index=index, **SHARDED
        )
    options = {k: v for k, v in SHARDED.items() if k != "num_shards"}
    run_preprocess(corpus[1:3], directory / "one", example_tokenizer, **options)
    return directory


def _copy_over(out: Path) -> tuple[int, str]:
    """The reported case: shard 0's .bin and .idx copied over shard 1's."""
    expected = f"{_shard(out, 1, '.bin').stat().st_size:,} bytes"
    for suffix in (".bin", ".idx"):
        _shard(out, 1, suffix).write_bytes(_shard(out, 0, suffix).read_bytes())
    found = f"{_shard(out, 1, '.bin').stat().st_size:,} bytes"
    return 1, f"x.shard-00001-of-00003.bin: {found}, but its shard manifest records {expected}"


def _flip_a_byte(out: Path) -> tuple[int, str]:
    path = _shard(out, 2, ".bin")
    data = bytearray(path.read_bytes())
    before = xxhash.xxh3_128_hexdigest(bytes(data))
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    after = xxhash.xxh3_128_hexdigest(bytes(data))
    return (
        2,
        f"{path.name}: content differs from its shard manifest (xxh3-128 {after}, "
        f"recorded {before})",
    )


def _truncate_the_idx(out: Path) -> tuple[int, str]:
    path = _shard(out, 0, ".idx")
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-8])
    return 0, f"{path.name}: {size - 8:,} bytes, but its shard manifest records {size:,} bytes"


def _old_manifest(out: Path) -> tuple[int, str]:
    """A manifest as hp-data wrote it before checksums: version 1, no `files`."""
    path = _shard(out, 1, ".json")
    manifest = json.loads(path.read_text())
    del manifest["files"]
    path.write_text(json.dumps({**manifest, "version": 1}))
    return 1, f"{path.name}: a shard manifest of version 1, not 2"


def _newer_manifest(out: Path) -> tuple[int, str]:
    """A manifest of a later hp-data, with fields this one does not know and without some
    it needs: judged by its version, not as a broken manifest of this one."""
    path = _shard(out, 2, ".json")
    manifest = json.loads(path.read_text())
    del manifest["units"]
    path.write_text(json.dumps({**manifest, "version": 3, "segments": [[0, 1]]}))
    return 2, f"{path.name}: a shard manifest of version 3, not 2 (from a newer hp-data); "


@pytest.mark.parametrize(
    "damage", [_copy_over, _flip_a_byte, _truncate_the_idx, _old_manifest, _newer_manifest]
)
def test_merge_refuses_shard_files_unlike_their_manifest_and_a_rerun_mends_it(
    tmp_path, finished_shards, corpus, example_tokenizer, damage
):
    out = tmp_path / "out"
    shutil.copytree(finished_shards, out)
    _write_user_files(out)
    index, problem = damage(out)
    result = CliRunner().invoke(main, ["merge", str(out / "x"), "--shards", "--quiet"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and problem in result.stderr, result.stderr
    assert f"rerun shard {index} (--num-shards 3 --shard-index {index})" in result.stderr
    assert not list(out.glob("x.[bih]*")) and not list(out.glob(".x.*")), "nothing at x"
    _assert_user_files_intact(out)
    # Doing as told: the rerun sees the damage (it does not skip a 'finished' shard), and
    # the merge then gives the one-machine bytes.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_preprocess(corpus[1:3], out / "x", example_tokenizer, shard_index=index, **SHARDED)
    merge_shards(str(out / "x"))
    assert read_bytes(out / "x", metadata=True) == read_bytes(out / "one", metadata=True)
    _assert_user_files_intact(out)


def test_preprocess_and_merge_leave_the_users_other_files_alone(
    tmp_path, corpus, example_tokenizer
):
    """Output in a directory the user keeps other things in: whether the commands succeed or
    fail, those files, and the datasets of earlier commands, keep their bytes."""
    out = tmp_path / "data"
    out.mkdir()
    _write_user_files(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(corpus[1].read_bytes() + b'{"text": 5}\n')
    tokenizer = ["--tokenizer", str(example_tokenizer), "--workers", "1", "--quiet"]

    def hp_data(*args: object) -> int:
        return CliRunner().invoke(main, [str(a) for a in args]).exit_code

    assert hp_data("preprocess", corpus[1], "--out", out / "x", *tokenizer) == 0
    # Prefixes that are the names of a user's file and directory, plus their suffixes.
    assert hp_data("preprocess", corpus[2], "--out", out / "notes.txt", *tokenizer) == 0
    assert hp_data("preprocess", corpus[2], "--out", out / "sub", *tokenizer) == 0
    # (`sub` alone names the directory, which merge reads as its *.idx files.)
    assert hp_data("merge", out / "m", out / "x", out / "sub.idx", "--quiet") == 0
    written = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    failing = [
        ("preprocess", bad, "--out", out / "x", "--unit-mb", "0.01", *tokenizer),
        ("preprocess", corpus[1], "--out", out / "x", "--tokenizer", out / "notes.txt"),
        ("merge", out / "m", out / "x", out / "x2", "--quiet"),
        ("merge", out / "m", out / "sub", "--quiet"),  # a directory without .idx files
        ("merge", out / "x", "--shards", "--quiet"),
    ]
    for args in failing:
        assert hp_data(*args) == 1, args
    _assert_user_files_intact(out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == written


def test_merge_named_by_a_megatron_dataset_prefix_names_the_run_to_merge(
    tmp_path, corpus, example_tokenizer
):
    """`--output-prefix P` writes `P_text_document.shard-*` with manifests `P.shard-*.json`;
    `merge P_text_document --shards` once read the shards' `.hp.json` as manifests."""
    options = {"num_shards": 2, "megatron_names": True, "unit_bytes": 20_000}
    for index in range(2):
        run_preprocess(corpus[1:2], tmp_path / "P", example_tokenizer, shard_index=index, **options)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert "P_text_document.shard-00000-of-00002.hp.json" in before  # what the glob also met
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "P_text_document"), "--shards"])
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: {tmp_path / 'P_text_document'}: a dataset of the sharded run {tmp_path / 'P'}; "
        f"merge with hp-data merge {tmp_path / 'P'} --shards (it writes each key's dataset, "
        "this one too)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    # Doing as told gives the one-machine run's dataset at the name first asked for.
    assert CliRunner().invoke(main, ["merge", str(tmp_path / "P"), "--shards"]).exit_code == 0
    one = run_preprocess(corpus[1:2], tmp_path / "one", example_tokenizer, megatron_names=True)
    assert read_bytes(tmp_path / "P_text_document", metadata=True) == read_bytes(
        one.outputs["text"], metadata=True
    )


@pytest.mark.parametrize("change", ["gap", "overlap", "garbage"])
def test_a_manifest_whose_units_do_not_follow_on_says_how(tmp_path, finished_shards, change):
    out = tmp_path / "out"
    shutil.copytree(finished_shards, out)
    path = _shard(out, 1, ".json")
    manifest = json.loads(path.read_text())
    end = json.loads(_shard(out, 0, ".json").read_text())["units"][1]  # where shard 0 ends
    stop = manifest["units"][1]
    start, problem = {
        "gap": (end + 1, f"leaves out units {end} to {end + 1}"),
        "overlap": (end - 1, f"repeats units {end - 1} to {end}"),
        "garbage": (None, None),
    }[change]
    units = "3-9" if start is None else [start, stop]
    path.write_text(json.dumps({**manifest, "units": units}))
    with pytest.raises(PreprocessError) as refused:
        merge_shards(str(out / "x"))
    if problem is None:
        expected = f"{path.name}: its 'units' is not [start, stop]; rerun shard 1"
    else:
        expected = (
            f"{path.name}: covers units {start} to {stop}, but the shards before it end at "
            f"unit {end}, so the merge {problem}; rerun it with the same command line"
        )
    assert expected in str(refused.value)
    assert not list(out.glob("x.[bih]*"))
