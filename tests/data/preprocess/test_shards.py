"""A run split into N shards (one per machine) merges into exactly a one-machine run's bytes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
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
    Path(f"{out}.shard-00002-of-00003.json").write_text('{"version": 1}')
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
