"""The tiktoken engine gives exactly `tokenizers`' ids, or is not used; proof is checked."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hp_data import IndexedDataset, PreprocessError
from hp_data.cli import main
from hp_data.fast_bpe import O200K_PATTERN, FastBPE, NotConvertible, compare, probe_texts
from hp_data.shards import merge_shards
from hp_data.tokenize import TokenizerFiles, VerifiedEngine
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from tests.helpers.bpe import (
    LLAMA3_PATTERN,
    adversarial_probes,
    convert_ranks,
    corpus_texts,
    rank_table,
    train_gpt2_style,
    train_llama3_style,
)
from tests.helpers.corpus_files import write_jsonl
from tests.helpers.run import cli, read_bytes, run_preprocess


def _reference(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """`tokenizers`' ids, one text at a time: the reference, not the code under test."""
    ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    flat = np.array([i for one in ids for i in one], dtype=np.int64)
    return flat, np.array([len(one) for one in ids], dtype=np.int64)


def _assert_same_ids(tokenizer_path, texts: list[str]) -> None:
    """The proof passes (the speed stays) and the ids are tokenizers'."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    described = json.loads(Path(tokenizer_path).read_text())
    engine = FastBPE.from_description(described, proven=True).engine()
    added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    for batch in (probe_texts(added), texts):
        mismatch = compare(batch, _reference(tokenizer, batch), engine.encode(batch))
        assert mismatch is None, (batch[mismatch.index], mismatch.describe())


@pytest.fixture(scope="module")
def texts(example_corpus) -> list[str]:
    return corpus_texts(example_corpus)


def test_the_shipped_tokenizer(example_tokenizer, texts):
    _assert_same_ids(example_tokenizer, texts)


def test_a_gpt2_style_tokenizer(tmp_path, texts):
    path = train_gpt2_style(texts, tmp_path / "gpt2.json")
    assert json.loads(path.read_text())["pre_tokenizer"]["type"] == "ByteLevel"
    _assert_same_ids(path, texts + ["<|endoftext|> inside a text<|endoftext|>"])


@pytest.mark.slow
def test_a_llama3_style_tokenizer(tmp_path, texts):
    path = train_llama3_style(texts, tmp_path / "llama3.json")
    described = json.loads(path.read_text())
    assert len(described["model"]["vocab"]) >= 100_000
    assert described["model"]["ignore_merges"] is True
    assert described["pre_tokenizer"]["pretokenizers"][0]["type"] == "Split"
    mixed = ["Ça va? 你好\uff0c世界\uff01 12345 I'LL <|end_of_text|> é\u0301 🙂\r\n\n  x" * 3]
    _assert_same_ids(path, texts + mixed)


def test_the_probe_set_catches_a_broken_conversion(example_tokenizer):
    """Two merges given each other's rank: a plausible conversion bug, found by the probes."""
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    recipe = FastBPE.from_tokenizer_json(example_tokenizer)
    ranks = dict(recipe.ranks)
    first, late = bytes([0x20]) + b"t", b"er"  # " t" and "er" are both merges of this vocab
    ranks[first], ranks[late] = ranks[late], ranks[first]
    ids = recipe.ids.copy()
    ids[[ranks[first], ranks[late]]] = ids[[ranks[late], ranks[first]]]  # the same ids out
    broken = FastBPE(recipe.pattern, ranks, recipe.specials, ids).engine()
    probes = probe_texts(["<|endoftext|>"])
    assert compare(probes, _reference(tokenizer, probes), broken.encode(probes)) is not None


def _with_a_trap(example_tokenizer, out) -> str:
    """The shipped tokenizer plus merges X+J, Q+X, QX+J: `tokenizers` turns "QXJ" into
    Q, XJ (no merge joins Q and XJ), tiktoken into the whole token QXJ. Letters the probe
    set never puts together: only the proof, or a document, can show the difference."""
    described = json.loads(example_tokenizer.read_text())
    vocab, merges = described["model"]["vocab"], described["model"]["merges"]
    for left, right in (("X", "J"), ("Q", "X"), ("QX", "J")):
        assert left + right not in vocab
        vocab[left + right] = len(vocab)
        merges.append([left, right])
    out.write_text(json.dumps(described))
    trap = Tokenizer.from_file(str(out))
    assert trap.encode("QXJ").tokens == ["Q", "XJ"]
    return str(out)


def _corpus(tmp_path, trap_line: int, lines: int = 300):
    records = [{"text": f"document {i} of the run, with some words."} for i in range(lines)]
    records[trap_line - 1] = {"text": "QXJ is where the engines part"}
    return write_jsonl(tmp_path / "c.jsonl", records)


def _assert_auto_wrote_tokenizers_ids(tmp_path, corpus, trap: str, trap_line: int) -> None:
    """`auto` fell back to tokenizers: its files equal an hf run's, the trap line included."""
    summary = run_preprocess([corpus], tmp_path / "auto", trap, workers=2, chunk_bytes=2048)
    assert summary.engine == "hf"
    run_preprocess([corpus], tmp_path / "hf", trap, tokenizer_engine="hf")
    assert read_bytes(tmp_path / "auto") == read_bytes(tmp_path / "hf")
    assert IndexedDataset(tmp_path / "auto").get_document(trap_line - 1).tolist() == (
        Tokenizer.from_file(trap).encode("QXJ is where the engines part").ids
    )


def test_a_trap_in_the_merges_is_proven_so_before_the_run(tmp_path, example_tokenizer):
    """The issue's case: the trap is in document 250, past the first 200 that are checked,
    and off the 1-in-1,000 sample; the proof finds it before the first document."""
    trap = _with_a_trap(example_tokenizer, tmp_path / "trap.json")
    corpus = _corpus(tmp_path, trap_line=250)
    why = r"tiktoken makes its token 'QXJ' of 'Q' \+ 'XJ', which is not one of its merges"
    with pytest.warns(UserWarning, match=rf"trap\.json: tiktoken is not exact for it: {why}"):
        _assert_auto_wrote_tokenizers_ids(tmp_path, corpus, trap, trap_line=250)
    forced = cli(
        "preprocess", corpus, "--out", tmp_path / "out", "--tokenizer", trap,
        "--tokenizer-engine", "tiktoken", "--quiet", "--workers", "1",
    )  # fmt: skip
    assert forced.returncode == 1
    assert forced.stderr.count("\n") == 1 and "Traceback" not in forced.stderr
    refusal = "--tokenizer-engine tiktoken cannot reproduce this tokenizer: tiktoken makes its"
    assert refusal in forced.stderr
    assert "use --tokenizer-engine auto or hf" in forced.stderr
    assert not list(tmp_path.glob("out*"))


@pytest.fixture
def unproven(monkeypatch):
    """The proof switched off, so that what stands behind it (the probe set and the documents
    checked during the run) is what a trap meets; and no recipe kept, so that no later
    run takes this unproven one for proven (hp_data/recipe_cache.py)."""
    monkeypatch.setattr("hp_data.fast_bpe.prove", lambda *args, **kwargs: None)
    monkeypatch.setenv("HP_DATA_TOKENIZER_CACHE", "off")


def test_a_difference_in_the_first_documents_falls_back_to_tokenizers(
    tmp_path, example_tokenizer, unproven
):
    trap = _with_a_trap(example_tokenizer, tmp_path / "trap.json")
    corpus = _corpus(tmp_path, trap_line=7)
    assert VerifiedEngine.choose(TokenizerFiles.locate(trap), Tokenizer.from_file(trap)).fast
    with pytest.warns(UserWarning, match=r"c\.jsonl:7: the tiktoken engine gave other ids"):
        _assert_auto_wrote_tokenizers_ids(tmp_path, corpus, trap, trap_line=7)
    assert not list(tmp_path.glob(".*"))  # no work directory left behind


def test_a_shard_that_falls_back_keeps_its_name(tmp_path, example_tokenizer, unproven):
    """One machine of a split run meets the difference during its run: it tokenizes its
    units again with tokenizers under its own shard name, so that the merge finds it and
    equals an hf run on one machine."""
    trap = _with_a_trap(example_tokenizer, tmp_path / "trap.json")
    corpus = _corpus(tmp_path, trap_line=7)
    warned = []
    for index in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_preprocess([corpus], tmp_path / "split", trap, units=2, num_shards=2,
                           shard_index=index)  # fmt: skip
        warned.append([str(warning.message) for warning in caught])
    assert len(warned[0]) == 1 and "c.jsonl:7: the tiktoken engine gave other ids" in warned[0][0]
    assert warned[1] == []  # line 7 is in shard 0's units only
    merge_shards(str(tmp_path / "split"))
    run_preprocess([corpus], tmp_path / "hf", trap, tokenizer_engine="hf")
    assert read_bytes(tmp_path / "split", metadata=True) == read_bytes(tmp_path / "hf", True)


def test_forced_tiktoken_stops_at_the_document(tmp_path, example_tokenizer, unproven):
    trap = _with_a_trap(example_tokenizer, tmp_path / "trap.json")
    corpus = _corpus(tmp_path, trap_line=250)
    result = CliRunner().invoke(main, [
        "preprocess", str(corpus), "--out", str(tmp_path / "out"), "--tokenizer", trap,
        "--tokenizer-engine", "tiktoken", "--verify", "--quiet", "--workers", "1",
    ])  # fmt: skip
    assert result.exit_code == 1
    assert "c.jsonl:250: the tiktoken engine gave other ids than tokenizers" in result.output
    assert "--tokenizer-engine hf" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out.bin").exists()


def test_text_the_split_regex_leaves_unmatched_is_kept(tmp_path, example_tokenizer, texts):
    """tokenizers keeps the text between a Split regex's matches as a piece, where tiktoken
    would drop it: here a lone "☃", which no alternative takes (and the probe set lacks)."""
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    pattern = LLAMA3_PATTERN.replace(r" ?[^\s\p{L}\p{N}]+", r" ?[^\s\p{L}\p{N}☃]+")
    assert pattern != LLAMA3_PATTERN
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.save(str(tmp_path / "gap.json"))
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("x☃☃ y")]
    assert pieces == ["x", "âĺĥâĺĥ", "Ġy"]  # the gap "☃☃" is one piece (in byte-level form)
    gaps = ["a ☃ b", "x☃", "☃☃ ☃x ☃", "1☃2\n☃\n", " ☃", "☃"]
    _assert_same_ids(tmp_path / "gap.json", gaps + [t.replace(" ", " ☃ ") for t in texts[:200]])


def test_documents_are_sampled_through_the_run(tmp_path, example_tokenizer):
    records = [{"text": f"line {i}: " + "some words " * (i % 7)} for i in range(5000)]
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    summary = run_preprocess([corpus], tmp_path / "out", example_tokenizer, chunk_bytes=1 << 15)
    assert summary.engine == "tiktoken"
    assert summary.probe_texts > 1000
    # The first chunk's first 200 documents, then about one in a thousand of every chunk.
    assert 200 <= summary.verified_documents < 200 + 5000 // 1000 + 15
    everything = run_preprocess(
        [corpus], tmp_path / "all", example_tokenizer, chunk_bytes=1 << 15, verify=True
    )
    assert everything.verified_documents == 5000
    assert read_bytes(tmp_path / "out") == read_bytes(tmp_path / "all")


def _nfc_tokenizer(tmp_path) -> str:
    described = json.loads(Tokenizer.from_file(str(_plain(tmp_path))).to_str())
    tokenizer = Tokenizer.from_str(json.dumps(described))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.save(str(tmp_path / "nfc.json"))
    return str(tmp_path / "nfc.json")


def _plain(tmp_path):
    tokenizer = Tokenizer(models.BPE(vocab={chr(c): c for c in range(33, 127)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "ws.json"))
    return tmp_path / "ws.json"


@pytest.mark.parametrize(
    ("make", "why"),
    [(_plain, "Whitespace"), (_nfc_tokenizer, "normalizer")],
)
def test_a_tokenizer_tiktoken_cannot_reproduce(tmp_path, make, why):
    path = str(make(tmp_path))
    with pytest.raises(NotConvertible, match=why):
        FastBPE.from_tokenizer_json(path)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "a b c"}, {"text": "d"}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto falls back quietly
        assert run_preprocess([corpus], tmp_path / "auto", path).engine == "hf"
    with pytest.raises(PreprocessError, match=f"cannot reproduce this tokenizer: .*{why}"):
        run_preprocess([corpus], tmp_path / "forced", path, tokenizer_engine="tiktoken")


def _split_then_bytes(regex: str) -> dict:
    """A tokenizer.json's pre-tokenizer part: Llama 3's layout with `regex` as its Split."""
    return {
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated"},
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
            ],
        }
    }


def test_refused_shapes(example_tokenizer):
    described = json.loads(example_tokenizer.read_text())
    FastBPE.from_description(described)  # as shipped: converts
    for change, why in [
        ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}}, "prefix space"),
        ({"truncation": {"max_length": 8}}, "truncation"),
        ({"added_tokens": [{"id": 0, "content": "<|endoftext|>", "lstrip": True}]}, "strips"),
        ({"model": {**described["model"], "byte_fallback": True}}, "byte_fallback"),
        ({"model": {**described["model"], "dropout": 0.1}}, "dropout"),
        (_split_then_bytes(r"(a)\1|."), "backreference"),
        (_split_then_bytes(r"\p{L}*"), "empty string"),
    ]:
        with pytest.raises(NotConvertible, match=why):
            FastBPE.from_description({**described, **change})


@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_bpe_dropout_is_refused(tmp_path, example_tokenizer, engine):
    """Dropout makes tokenizers' own ids random: two runs would write different files."""
    described = json.loads(example_tokenizer.read_text())
    described["model"]["dropout"] = 0.1
    (tmp_path / "dropout.json").write_text(json.dumps(described))
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "some words to drop out of"}] * 20)
    result = cli(
        "preprocess", corpus, "--out", tmp_path / "out", "--tokenizer", tmp_path / "dropout.json",
        "--tokenizer-engine", engine, "--quiet", "--workers", "1",
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "dropout.json: model.dropout is 0.1: BPE dropout" in result.stderr
    assert not list(tmp_path.glob("out*"))


# -- tokenizers converted from tiktoken (Llama 3, Qwen, o200k): several merges a token ---------


@pytest.fixture(scope="module")
def trained_ranks(tmp_path_factory, texts) -> dict[bytes, int]:
    """A 32k rank table trained here (the example corpus and made-up words)."""
    trained = train_llama3_style(texts, tmp_path_factory.mktemp("ranks") / "t.json", 32_000)
    return rank_table(trained)


@pytest.mark.parametrize("pattern", [LLAMA3_PATTERN, O200K_PATTERN], ids=["llama3", "o200k"])
def test_a_converted_tokenizer_runs_on_tiktoken_with_tokenizers_ids(
    tmp_path, texts, trained_ranks, pattern
):
    """The tokenizer.json users download for Llama 3 or Qwen (transformers' converter's output,
    every two-token split a merge): proven, chosen by `auto`, and tokenizers' ids on the corpus,
    the probe set and 3,200 adversarial texts."""
    path = convert_ranks(trained_ranks, pattern, ["<|begin_of_text|>"], tmp_path / "tok.json")
    described = json.loads(path.read_text())
    merges = described["model"]["merges"]
    assert len(merges) > 2 * len(trained_ranks)  # the converted form: many merges a token
    engine = VerifiedEngine.choose(TokenizerFiles.locate(str(path)), Tokenizer.from_file(str(path)))
    assert engine.fast and engine.notice is None
    probes = adversarial_probes()
    _assert_same_ids(path, texts + probes + ["<|begin_of_text|>x<|begin_of_text|> "])


def test_preprocess_auto_writes_a_converted_tokenizers_files_with_tiktoken(
    tmp_path, example_corpus, trained_ranks
):
    path = convert_ranks(trained_ranks, LLAMA3_PATTERN, ["<|end_of_text|>"], tmp_path / "tok.json")
    fast = run_preprocess([example_corpus], tmp_path / "fast", path, append_eod=True)
    slow = run_preprocess(
        [example_corpus], tmp_path / "slow", path, append_eod=True, tokenizer_engine="hf"
    )
    assert (fast.engine, slow.engine) == ("tiktoken", "hf")
    assert read_bytes(tmp_path / "fast") == read_bytes(tmp_path / "slow")


def test_a_converted_tokenizer_the_proof_cannot_cover_falls_back_with_one_warning(
    tmp_path, example_corpus, trained_ranks
):
    """One token's own split taken out of its merges (a hand-edited or truncated file): auto
    warns once, naming the token, and writes tokenizers' ids."""
    path = convert_ranks(trained_ranks, LLAMA3_PATTERN, ["<|end_of_text|>"], tmp_path / "tok.json")
    described = json.loads(path.read_text())
    described["model"]["merges"].remove(["Ġt", "he"])
    path.write_text(json.dumps(described))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run_preprocess([example_corpus], tmp_path / "out", path, append_eod=True)
    notices = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(notices) == 1, notices
    assert (
        "tiktoken is not exact for it: tiktoken makes its token 'Ġthe' of 'Ġt' + 'he'"
        in (notices[0])
    )
    run_preprocess([example_corpus], tmp_path / "ref", path, append_eod=True, tokenizer_engine="hf")
    assert summary.engine == "hf"
    assert read_bytes(tmp_path / "out") == read_bytes(tmp_path / "ref")
