"""SentencePiece models, read as Megatron's GPTSentencePieceTokenizer reads them."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hp_data import IndexedDataset
from hp_data.cli import main

from tests.helpers.bpe import corpus_texts

sentencepiece = pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def model(tmp_path_factory, example_corpus) -> str:
    """A 600-piece BPE model trained here on the example corpus."""
    prefix = tmp_path_factory.mktemp("spm") / "m"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_texts(example_corpus)[:800]),
        model_prefix=str(prefix),
        vocab_size=600,
        model_type="bpe",
        minloglevel=2,
    )
    return f"{prefix}.model"


def test_megatrons_sentencepiece_command_line(tmp_path, model, example_corpus):
    texts = corpus_texts(example_corpus)[:300]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = ["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "sp")]
    args += ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    args += ["--append-eod", "--workers", "2", "--quiet", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["engine"] == "sentencepiece"
    reference = sentencepiece.SentencePieceProcessor(model_file=model)
    dataset = IndexedDataset(tmp_path / "sp_text_document")
    for d, text in enumerate(texts):
        expected = reference.encode_as_ids(text) + [reference.eos_id()]
        assert dataset.get_document(d).tolist() == expected

    # The model is recorded beside the dataset: inspect decodes without being told.
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "sp_text_document"), "--show", "1"])
    assert shown.exit_code == 0, shown.output
    assert f"--- document 0 ---\n{reference.decode(dataset.get_document(0).tolist())}" in (
        shown.output
    )


def test_what_cannot_read_a_sentencepiece_model_says_so(tmp_path, model, example_tokenizer):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b"}\n')
    base = ["preprocess", str(corpus), "--out", str(tmp_path / "o"), "--quiet", "--workers", "1"]
    forced = CliRunner().invoke(
        main, [*base, "--tokenizer", model, "--tokenizer-engine", "tiktoken"]
    )
    assert forced.exit_code == 1
    assert "cannot reproduce this tokenizer: it is a SentencePiece model" in forced.output
    typed = CliRunner().invoke(
        main,
        [*base, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(example_tokenizer)],
    )
    assert typed.exit_code == 1
    assert "reads a SentencePiece .model" in typed.output
