"""A Megatron user's preprocess command line works unchanged, with tokenizers where they are."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hp_data import IndexedDataset
from hp_data.cli import main
from hp_data.pipeline import megatron_keys
from hp_data.tokenize import TokenizerFiles
from tokenizers import Tokenizer

from tests.helpers.corpus_files import write_jsonl
from tests.helpers.hub_server import COMMIT, hub_server
from tests.helpers.megatron import build_megatron
from tests.helpers.run import cli, read_bytes


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, example_tokenizer) -> tuple[Path, Path]:
    """The shipped tokenizer written as GPT-2's vocab.json + merges.txt."""
    folder = tmp_path_factory.mktemp("gpt2")
    described = json.loads(example_tokenizer.read_text())
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    vocab.write_text(json.dumps(described["model"]["vocab"]))
    lines = "".join(" ".join(pair) + "\n" for pair in described["model"]["merges"])
    merges.write_text("#version: 0.2\n" + lines)
    return vocab, merges


def _records(count: int = 40) -> list[dict]:
    return [
        {"text": f"Document {i} says: it's {i * 37} o'clock <|endoftext|> here.", "title": f"T{i}"}
        for i in range(count)
    ]


def test_a_megatron_command_line_writes_what_megatron_reads(tmp_path, gpt2_files):
    """preprocess_data.py's flags; megatron-core's GPTDataset opens the output by the same
    --data-path; ids are transformers' GPT2Tokenizer's (the slow Python one) plus EOD."""
    from transformers import GPT2Tokenizer

    corpus = write_jsonl(tmp_path / "c.jsonl", _records())
    vocab, merges = gpt2_files
    result = cli(
        "preprocess", "--input", corpus, "--output-prefix", tmp_path / "my-corpus",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
        "--json-keys", "text", "--append-eod", "--workers", "2", "--log-interval", "1000",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--log-interval is Megatron's; hp-data ignores it" in result.stderr
    data_path = str(tmp_path / "my-corpus_text_document")
    # split_special_tokens: "<|endoftext|>" in text is text, as in Megatron's GPT2BPETokenizer.
    reference = GPT2Tokenizer(str(vocab), str(merges), split_special_tokens=True)
    eod = reference.convert_tokens_to_ids("<|endoftext|>")
    expected = [reference.encode(r["text"]) + [eod] for r in _records()]
    dataset = IndexedDataset(data_path)
    assert [dataset.get_document(d).tolist() for d in range(len(expected))] == expected
    # The text's own "<|endoftext|>" did not become EOD.
    assert all(document.count(eod) == 1 for document in expected)
    # inspect finds vocab.json + merges.txt through the dataset's own record.
    shown = CliRunner().invoke(main, ["inspect", data_path, "--show", "1"])
    assert shown.exit_code == 0, shown.output
    assert f"--- document 0 ---\n{reference.decode(expected[0])}\n" in shown.output

    train, _, _ = build_megatron(
        [8, None, None], 16, 1234, blend=([data_path], None), split="1,0,0", eod=eod
    )
    tokens = np.concatenate([np.asarray(train[i]["tokens"]) for i in range(len(train))])
    assert set(tokens.tolist()) <= {t for document in expected for t in document}


def test_output_prefix_names_every_key_as_megatron_does(tmp_path, example_tokenizer):
    corpus = write_jsonl(tmp_path / "c.jsonl", _records(5))
    runner = CliRunner()
    args = ["preprocess", "--input", str(corpus), "--tokenizer-model", str(example_tokenizer)]
    args += ["--workers", "1", "--quiet", "--json-keys", "text,title"]
    result = runner.invoke(main, [*args, "--output-prefix", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.glob("p_*")) == [
        "p_text_document.bin", "p_text_document.hp.json", "p_text_document.hp.sources",
        "p_text_document.idx", "p_title_document.bin", "p_title_document.hp.json",
        "p_title_document.hp.sources", "p_title_document.idx",
    ]  # fmt: skip
    one = runner.invoke(main, [*args[:-1], "text", "--output-prefix", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    assert read_bytes(tmp_path / "one_text_document") == read_bytes(tmp_path / "p_text_document")


def test_the_python_api_reads_json_keys_as_both_command_lines_give_them():
    # Megatron's `--json-keys text title` (argparse: one key a value) and hp's `text,title`.
    assert megatron_keys(["text", "title"]) == ("text", "title")
    assert megatron_keys(["text,title"]) == megatron_keys([" text  title "]) == ("text", "title")
    assert megatron_keys(["title", "text,body"]) == ("title", "text", "body")  # order kept
    assert megatron_keys([""]) == ()  # nothing to tokenize: preprocess refuses it by name


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--split-sentences"], 2, "does not split sentences"),
        (["--tokenizer-type", "GPT2BPETokenizer"], 1, "--vocab-file vocab.json and --merge-file"),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file", "v", "--merge-file", "m"],
            1,
            "HuggingFaceTokenizer reads --tokenizer-model (a hub name or a directory), not --vocab",
        ),
        (["--tokenizer-type", "SentencePieceTokenizer"], 2, "'SentencePieceTokenizer' is not"),
        (["--output-prefix", "x", "--out", "y"], 2, "--out or as --output-prefix"),
    ],
)
def test_what_hp_cannot_do_is_said(tmp_path, example_tokenizer, extra, code, message):
    corpus = write_jsonl(tmp_path / "c.jsonl", _records(2))
    args = ["preprocess", "--input", str(corpus), "--quiet", "--workers", "1"]
    if "--tokenizer-type" not in extra:
        args += ["--tokenizer", str(example_tokenizer)]
    if "--out" not in extra:
        args += ["--output-prefix", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args + extra)
    assert result.exit_code == code, result.output
    assert message in result.output
    assert not list(tmp_path.glob("out*"))


def _hub_cache(root: Path, name: str, tokenizer: Path) -> None:
    """A Hugging Face hub cache entry for `name`, laid out as huggingface_hub writes one."""
    repo = root / f"models--{name.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    config = {"eos_token": "<|endoftext|>", "model_max_length": 1024}
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config))


def test_a_hub_name_resolves_in_the_local_cache_offline(tmp_path, example_tokenizer):
    cache = tmp_path / "hub"
    _hub_cache(cache, "hp-org/tiny-bpe", example_tokenizer)
    corpus = write_jsonl(tmp_path / "c.jsonl", _records(5))
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    env.pop("HF_HOME", None)
    command = [
        "preprocess", corpus, "--out", tmp_path / "hub", "--tokenizer-type",
        "HuggingFaceTokenizer", "--tokenizer-model", "hp-org/tiny-bpe", "--append-eod",
        "--workers", "1", "--json", "--quiet",
    ]  # fmt: skip
    result = cli(*command, env=env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    # Where huggingface_hub itself finds the file (the reference for the cache layout).
    found = _try_to_load_from_cache(cache, "hp-org/tiny-bpe")
    assert summary["tokenizer"]["source"] == "hp-org/tiny-bpe"
    assert os.path.samefile(summary["tokenizer"]["path"], found)
    local = cli(*command[:2], "--out", tmp_path / "local", "--tokenizer", example_tokenizer,
                "--append-eod", "--workers", "1", "--quiet")  # fmt: skip
    assert local.returncode == 0, local.stderr
    assert read_bytes(tmp_path / "hub") == read_bytes(tmp_path / "local")

    missing = cli(*command[:4], "--tokenizer", "hp-org/not-cached", "--quiet", env=env)
    assert missing.returncode == 1
    assert "hp-org/not-cached: no such file or directory, and not in the Hugging Face cache" in (
        missing.stderr
    )
    assert "--allow-download" in missing.stderr and "Traceback" not in missing.stderr

    # Elsewhere, with the hub cache somewhere else: the recorded hub name finds it again.
    moved = tmp_path / "another-cache"
    cache.rename(moved)
    shown = cli("inspect", tmp_path / "hub", "--show", "1", env={**env, "HF_HUB_CACHE": str(moved)})
    assert shown.returncode == 0, shown.stderr
    ids = IndexedDataset(str(tmp_path / "hub")).get_document(0).tolist()
    text = Tokenizer.from_file(str(example_tokenizer)).decode(ids)
    assert f"--- document 0 ---\n{text}\n" in shown.stdout


def _try_to_load_from_cache(cache: Path, name: str) -> str:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "tokenizer.json", cache_dir=str(cache))
    assert isinstance(found, str)
    return found


def test_allow_download_fetches_only_tokenizer_files_and_then_works_offline(
    tmp_path, example_tokenizer
):
    """Against a real HTTP hub endpoint (`HF_ENDPOINT`): offline unless allowed, then the
    tokenizer files only (never weights), then from the cache with the hub gone."""
    files = {
        "tokenizer.json": example_tokenizer.read_bytes(),
        "tokenizer_config.json": b'{"eos_token": "<|endoftext|>"}',
        "model.safetensors": b"\0" * 4096,
        "config.json": b"{}",
    }
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    cache = tmp_path / "hub-cache"
    command = ["preprocess", corpus, "--tokenizer", "hp-org/tiny", "--append-eod"]
    command += ["--workers", "1", "--quiet"]
    with hub_server("hp-org/tiny", files) as (endpoint, requested):
        env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache)}
        env.pop("HF_HUB_OFFLINE", None)
        offline = cli(*command, "--out", tmp_path / "refused", env=env)
        assert offline.returncode == 1 and "fetch it with --allow-download" in offline.stderr
        assert requested == []  # offline by default: not one request
        fetched = cli(*command, "--out", tmp_path / "fetched", "--allow-download", env=env)
        assert fetched.returncode == 0, fetched.stderr
        assert fetched.stderr == ""  # --quiet hides huggingface_hub's download bars too
        downloads = {p.rsplit("/", 1)[1] for p in requested if "/resolve/" in p}
        assert downloads == {"tokenizer.json", "tokenizer_config.json"}
    snapshot = cache / "models--hp-org--tiny" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    again = cli(*command, "--out", tmp_path / "cached", env=env)  # the server is gone
    assert again.returncode == 0, again.stderr
    reference = Tokenizer.from_file(str(example_tokenizer))
    expected = reference.encode("hello world").ids + [reference.token_to_id("<|endoftext|>")]
    for out in ("fetched", "cached"):
        assert IndexedDataset(str(tmp_path / out)).get_document(0).tolist() == expected


def _hub_env(endpoint: str, cache: Path) -> dict[str, str]:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache)}
    env.pop("HF_HUB_OFFLINE", None)
    return env


def test_what_the_hub_answered_is_said(tmp_path):
    """A repository the hub does not have (a plain 404, and huggingface.co's own 401 with
    RepoNotFound), one without tokenizer files, and a hub that is down: one line each, and
    only the last says the hub could not be reached."""
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    weights = {"model.safetensors": b"\0" * 64, "config.json": b"{}"}

    def run(name: str, endpoint: str) -> subprocess.CompletedProcess[str]:
        return cli(
            "preprocess", corpus, "--out", tmp_path / "out", "--tokenizer", name,
            "--allow-download", "--quiet", "--workers", "1",
            env=_hub_env(endpoint, tmp_path / "cache"),
        )  # fmt: skip

    answers = {}
    with hub_server("hp-org/weights", weights) as (endpoint, _):
        answers["404"] = run("hp-org/missing", endpoint)
        answers["no tokenizer"] = run("hp-org/weights", endpoint)
    with hub_server("hp-org/weights", weights, as_the_hub=True) as (endpoint, _):
        answers["401"] = run("hp-org/missing", endpoint)
    answers["down"] = run("hp-org/missing", endpoint)  # the server is gone
    for why, result in answers.items():
        assert result.returncode == 1, why
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, why
    for why in ("404", "401"):
        assert "hp-org/missing: the Hugging Face hub (http://127.0.0.1:" in answers[why].stderr
        assert "has no model repository of that name" in answers[why].stderr
    assert "hp-org/weights: the Hugging Face hub repository has no tokenizer.json" in (
        answers["no tokenizer"].stderr
    )  # and not huggingface_hub's "No files matched allow_patterns" under --quiet
    assert "hp-org/missing: could not reach the Hugging Face hub" in answers["down"].stderr
    assert not list(tmp_path.glob("out*"))


def test_a_damaged_cached_tokenizer_is_fetched_again(tmp_path, example_tokenizer):
    """A cached tokenizer.json whose bytes are not the hub's (here two ids swapped: it would
    load, and give other ids) is refused offline, naming the cached copy, and fetched again
    with --allow-download."""
    files = {"tokenizer.json": example_tokenizer.read_bytes()}
    reference = Tokenizer.from_file(str(example_tokenizer)).encode("hello world").ids
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    cache = tmp_path / "cache"
    command = ["preprocess", corpus, "--tokenizer", "hp-org/tiny", "--workers", "1", "--quiet"]
    with hub_server("hp-org/tiny", files) as (endpoint, requested):
        env = _hub_env(endpoint, cache)
        fetched = cli(*command, "--out", tmp_path / "fetched", "--allow-download", env=env)
        assert fetched.returncode == 0, fetched.stderr
        cached = cache / "models--hp-org--tiny" / "snapshots" / COMMIT / "tokenizer.json"
        described = json.loads(cached.read_text())
        vocab = described["model"]["vocab"]
        vocab["hello"], vocab["Ġworld"] = vocab["Ġworld"], vocab["hello"]
        damaged = json.dumps(described)
        assert Tokenizer.from_str(damaged).encode("hello world").ids != reference
        Path(os.path.realpath(cached)).write_text(damaged)  # the blob the snapshot links to
        offline = cli(*command, "--out", tmp_path / "offline", env=env)
        assert offline.returncode == 1
        assert offline.stderr.count("\n") == 1 and "Traceback" not in offline.stderr
        assert f"hp-org/tiny: the cached copy at {cached} is damaged" in offline.stderr
        assert "--allow-download" in offline.stderr
        del requested[:]
        again = cli(*command, "--out", tmp_path / "again", "--allow-download", env=env)
        assert again.returncode == 0, again.stderr
        assert [p for p in requested if p.endswith("/tokenizer.json")]  # fetched again
    assert cached.read_bytes() == example_tokenizer.read_bytes()
    assert read_bytes(tmp_path / "again") == read_bytes(tmp_path / "fetched")
    assert IndexedDataset(str(tmp_path / "again")).get_document(0).tolist() == reference
    assert not list(tmp_path.glob("offline*"))


def test_gpt2_files_named_relatively_load_from_another_directory(tmp_path, gpt2_files, monkeypatch):
    """What a Ray task gets: the tokenizer by absolute paths, as it starts elsewhere."""
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_files
    monkeypatch.chdir(vocab.parent)
    files = TokenizerFiles.from_gpt2_files(vocab.name, merges.name).absolute()
    monkeypatch.chdir(tmp_path)
    assert files.gpt2 == (str(vocab), str(merges))
    text = "Relative paths, it's 12 o'clock."
    reference = GPT2Tokenizer(str(vocab), str(merges))
    assert files.load().encode(text).ids == reference.encode(text)


def test_inspect_show_fetches_a_recorded_hub_tokenizer_only_with_allow_download(
    tmp_path, example_tokenizer
):
    """inspect --show advised --allow-download, which inspect did not take: it takes it now,
    and fetches only then (the record's bytes still checked)."""
    files = {"tokenizer.json": example_tokenizer.read_bytes(), "model.safetensors": b"\0" * 64}
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    with hub_server("hp-org/shown", files) as (endpoint, requested):
        env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "first")}
        env.pop("HF_HUB_OFFLINE", None)
        made = cli("preprocess", corpus, "--out", tmp_path / "d", "--tokenizer", "hp-org/shown",
                   "--allow-download", "--workers", "1", "--quiet", env=env)  # fmt: skip
        assert made.returncode == 0, made.stderr
        env["HF_HUB_CACHE"] = str(tmp_path / "elsewhere")  # the recorded files are not here
        (tmp_path / "first").rename(tmp_path / "gone")
        fetched = len(requested)
        refused = cli("inspect", tmp_path / "d", "--show", "1", env=env)
        assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1
        assert "hp-org/shown: no such file or directory, and not in the Hugging Face cache" in (
            refused.stderr
        )
        assert "fetch it with --allow-download" in refused.stderr
        assert len(requested) == fetched  # offline unless allowed
        shown = cli("inspect", tmp_path / "d", "--show", "1", "--allow-download", env=env)
        assert shown.returncode == 0, shown.stderr
    ids = IndexedDataset(str(tmp_path / "d")).get_document(0).tolist()
    text = Tokenizer.from_file(str(example_tokenizer)).decode(ids)
    assert shown.stdout.endswith(f"--- document 0 ---\n{text}\n")
