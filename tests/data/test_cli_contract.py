"""The command line's contract (docs/cli.md): --json keys as documented, the same shape on
failure, --json and --quiet on every command, a closed stdout ends quietly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from hp_data.cli import main

from tests.conftest import REPO
from tests.helpers.run import HP_DATA, documented_json_keys

COMMON = {"schema", "ok", "problems"}


def _run(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.stdout.count("\n") == 1, result.output  # one object, one line
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, example_corpus, example_tokenizer) -> dict[str, dict]:
    """Each documented command's --json output (the Ray variant has its own test)."""
    tmp = tmp_path_factory.mktemp("contract")
    common = ["--tokenizer", example_tokenizer, "--workers", "1", "--quiet", "--json"]
    runs = {
        "hp-data preprocess --json": ["preprocess", example_corpus, "--out", tmp / "a", *common],
        "hp-data inspect --json": ["inspect", tmp / "a", "--show", "1", "--tokenizer",
                                   example_tokenizer, "--json"],
        "hp-data merge --json": ["merge", tmp / "m", tmp / "a", tmp / "a2", "--json", "--quiet"],
        "hp-data plan --json": ["plan", example_corpus, "--num-shards", "2", "--json"],
        "hp-data merge --shards --json": ["merge", tmp / "s", "--shards", "--json", "--quiet"],
        "hp-data build-index --json": ["build-index", "--data-path", tmp / "a", "--seq-len", "64",
                                       "--cache-dir", tmp / "cache", "--json", "--quiet"],
    }  # fmt: skip
    _run("preprocess", example_corpus, "--out", tmp / "a2", *common)
    for index in range(2):
        _run(
            "preprocess", example_corpus, "--out", tmp / "s", *common,
            "--num-shards", "2", "--shard-index", str(index),
        )  # fmt: skip
    found = {}
    for heading, args in runs.items():
        code, found[heading] = _run(*args)
        assert code == 0, found[heading]
    return found


def test_each_command_prints_the_documented_keys(outputs):
    documented = documented_json_keys()
    assert set(documented) == {*outputs, "hp-data preprocess --ray --json"}
    for heading, output in outputs.items():
        assert set(output) == documented[heading] | COMMON, heading
        assert output["schema"] == 1 and output["ok"] is True and output["problems"] == []


def test_a_failure_has_the_same_shape(tmp_path, example_tokenizer):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    code, failed = _run(
        "preprocess", tmp_path / "bad.jsonl", "--out", tmp_path / "o",
        "--tokenizer", example_tokenizer, "--workers", "1", "--json",
    )  # fmt: skip
    assert code == 1
    assert failed["schema"] == 1 and failed["ok"] is False
    assert failed["problems"] == [
        f"{tmp_path / 'bad.jsonl'}:2: malformed JSON: " + ("Expecting value (column 10)")
    ]
    code, missing = _run("inspect", tmp_path / "nothing", "--check", "--json")
    assert code == 1 and missing["ok"] is False and "nothing.idx" in missing["problems"][0]
    (tmp_path / "cut.bin").write_bytes(b"")
    (tmp_path / "cut.idx").write_bytes(b"MMIDIDX\x00\x00")
    code, broken = _run("inspect", tmp_path / "cut", "--check", "--json")
    assert code == 1 and set(broken) == COMMON | {"prefix"} and broken["problems"]


def test_every_command_has_json_and_quiet():
    for name, command in main.commands.items():
        options = {option for param in command.params for option in param.opts}
        assert {"--json", "--quiet"} <= options, name


def test_a_closed_stdout_ends_quietly(tmp_path, example_corpus, example_tokenizer):
    out = tmp_path / "a"
    made = subprocess.run(
        [HP_DATA, "preprocess", example_corpus, "--out", out, "--tokenizer", example_tokenizer,
         "--quiet", "--workers", "1"], capture_output=True, text=True,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = subprocess.run(
        ["bash", "-c", f'"{HP_DATA}" inspect {out} --show 2000 --tokenizer '
         f'{example_tokenizer} | head -2; exit "${{PIPESTATUS[0]}}"'],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"dataset    {out}", "dtype      uint16"]
    assert result.stderr == ""


def test_the_python_api_of_preprocess_costs_nothing_until_used(tmp_path, example_corpus):
    script = (
        "import sys, hp_data\n"
        "assert 'hp_data.pipeline' not in sys.modules\n"
        "from hp_data import preprocess, PreprocessOptions\n"
        "from hp_data.pipeline import preprocess as the_pipeline\n"
        "assert preprocess is the_pipeline and hp_data.preprocess is the_pipeline\n"
        "options = PreprocessOptions(workers=1, show_progress=False)\n"
        f"summary = preprocess([{str(example_corpus)!r}], {str(tmp_path / 'a')!r}, "
        f"{str(REPO / 'examples' / 'tokenizer.json')!r}, options)\n"
        "print(summary.as_dict()['documents_written'])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(sum(1 for _ in example_corpus.open()))
