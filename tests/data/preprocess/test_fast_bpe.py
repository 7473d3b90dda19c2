"""The static proof behind `--tokenizer-engine auto` (`fast_bpe.prove`): wherever it lets
tiktoken run, tiktoken gives `tokenizers`' ids for every text; where it refuses, the two engines
do part on some text. Tokenizers are built by `tokenizers` from generated merges, adversarial
ones included; the reference is `tokenizers`' own `encode`, one text at a time."""

from __future__ import annotations

import json

import pytest
from hp_data.fast_bpe import LLAMA3_PATTERN, O200K_PATTERN, FastBPE, NotProven
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from tests.helpers.bpe import convert_ranks, with_merges

LETTERS = "abc"

# The reproducer: "~`|" is the merge ~` + |, but `| is made first, so tokenizers
# stops at ~ + `| where tiktoken joins them; and the same shape in letters.
TRAPS = [[("`", "|"), ("~", "`"), ("~`", "|")], [("X", "J"), ("Q", "X"), ("QX", "J")]]


def _ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]


def _tiktoken_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """tiktoken's ids, converted without the proof: what running it anyway would give."""
    ids, lengths = FastBPE.from_description(json.loads(tokenizer.to_str())).engine().encode(texts)
    ends = lengths.cumsum()
    return [ids[end - length : end].tolist() for end, length in zip(ends, lengths, strict=True)]


def _proven(tokenizer: Tokenizer) -> bool:
    try:
        FastBPE.from_description(json.loads(tokenizer.to_str()), proven=True)
    except NotProven:
        return False
    return True


@st.composite
def merge_lists(draw: st.DrawFn) -> list[tuple[str, str]]:
    """Up to 20 merges of earlier tokens over three letters, in random order: short tokens
    that overlap, so that a token's parts often form in an order its merge does not expect."""
    tokens, merges = list(LETTERS), []
    for _ in range(draw(st.integers(1, 20))):
        left, right = draw(st.sampled_from(tokens)), draw(st.sampled_from(tokens))
        if left + right not in tokens and len(left + right) <= 6:
            merges.append((left, right))
            tokens.append(left + right)
    return merges


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    merges=merge_lists(),
    llama3=st.booleans(),
    texts=st.lists(st.text(LETTERS + " \n", max_size=24), max_size=6),
)
def test_where_the_proof_passes_tiktoken_gives_tokenizers_ids(merges, llama3, texts):
    tokenizer = with_merges(merges, llama3)
    made = [left + right for left, right in merges]
    # Each token's own text, and tokens next to one another, beside the random texts.
    texts = [*texts, *made, "".join(made), " ".join(made), "".join(reversed(made))]
    if _proven(tokenizer):
        event("proven")
        assert _tiktoken_ids(tokenizer, texts) == _ids(tokenizer, texts)
        return
    event("refused")
    if not llama3:  # then the refusal is no false alarm: on some token's text the engines part
        assert _tiktoken_ids(tokenizer, made) != _ids(tokenizer, made)


@pytest.mark.parametrize("llama3", [False, True], ids=["gpt2", "llama3"])
@pytest.mark.parametrize("merges", TRAPS, ids=["issue", "letters"])
def test_the_adversarial_merges_are_refused(merges, llama3):
    tokenizer = with_merges(merges, llama3)
    why = "makes its token '...' of '.' \\+ '..', which is not one of its merges"
    with pytest.raises(NotProven, match=why):
        FastBPE.from_description(json.loads(tokenizer.to_str()), proven=True)
    # And the refusal is needed: without it, tiktoken writes other ids.
    texts = ["".join(left + right for left, right in merges[-1:]) + merges[0][0] * 2]
    texts += ["a" + merges[-1][0] + merges[-1][1] + "~"]
    assert _tiktoken_ids(tokenizer, texts) != _ids(tokenizer, texts)


def test_merges_that_agree_are_proven():
    """The same letters with the merges in an order tokenizers reaches: no false alarm."""
    for llama3 in (False, True):
        assert _proven(with_merges([("Q", "X"), ("X", "J"), ("QX", "J")], llama3))


def test_a_token_no_merge_makes_is_refused():
    """Under ignore_merges, a vocabulary token that no merge makes: tokenizers emits it only
    as a whole piece, tiktoken also joins it inside a longer one."""
    tokenizer = with_merges([("a", "b"), ("b", "c")], llama3=True)
    vocab = {**tokenizer.get_vocab(), "abc": tokenizer.get_vocab_size()}
    tokenizer.model = models.BPE(vocab=vocab, merges=[("a", "b"), ("b", "c")], ignore_merges=True)
    why = "makes its token 'abc' of 'ab' \\+ 'c', which is not one of its merges"
    with pytest.raises(NotProven, match=why):
        FastBPE.from_description(json.loads(tokenizer.to_str()), proven=True)
    assert _tiktoken_ids(tokenizer, ["abca"]) != _ids(tokenizer, ["abca"])


# -- tokenizers converted from tiktoken rank tables (several merges make one token) -----------


@st.composite
def rank_tables(draw: st.DrawFn) -> dict[bytes, int]:
    """Every byte, then up to 24 tokens each joined from two earlier ones over three letters
    (as a trainer makes them), in rank order: a tiktoken table whose tokens overlap a lot, so
    that a token has several two-token splits and its parts form in many orders."""
    tokens = [bytes([b]) for b in range(256)]
    letters = [t.encode() for t in LETTERS]
    for _ in range(draw(st.integers(1, 24))):
        left, right = draw(st.sampled_from(letters)), draw(st.sampled_from(letters))
        if left + right not in tokens and len(left + right) <= 7:
            tokens.append(left + right)
            letters.append(left + right)
    return {token: rank for rank, token in enumerate(tokens)}


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    ranks=rank_tables(),
    o200k=st.booleans(),
    dropped=st.sets(st.integers(0, 60), max_size=3),
    texts=st.lists(st.text(LETTERS + " \nA", max_size=30), max_size=6),
)
def test_converted_tables_where_the_proof_passes_give_tokenizers_ids(
    tmp_path_factory, ranks, o200k, dropped, texts
):
    """transformers' converter's own output is always proven (each token's own split is among
    its merges); with a few of its merges dropped it may not be, and wherever it still is,
    tiktoken gives tokenizers' ids."""
    out = tmp_path_factory.mktemp("converted") / "tokenizer.json"
    convert_ranks(ranks, O200K_PATTERN if o200k else LLAMA3_PATTERN, ["<|end|>"], out)
    tokenizer = Tokenizer.from_file(str(out))
    assert _proven(tokenizer)
    texts = [*texts, "".join(t.decode() for t in list(ranks)[256:]) * 2]
    assert _tiktoken_ids(tokenizer, texts) == _ids(tokenizer, texts)
    described = json.loads(out.read_text())
    merges = described["model"]["merges"]
    described["model"]["merges"] = [m for i, m in enumerate(merges) if i not in dropped]
    partial = Tokenizer.from_str(json.dumps(described))
    if _proven(partial):
        event("proven with merges dropped")
        assert _tiktoken_ids(partial, texts) == _ids(partial, texts)
    else:
        event("refused")


def test_a_converted_table_missing_a_tokens_own_split_is_refused(tmp_path):
    """'aaa' is made of 'aa' + 'a' by tiktoken (the leftmost pair first); without that merge
    tokenizers can only reach it as 'a' + 'aa', and the two engines part on 'aaa' inside a
    piece: the proof names the token, and the refusal is needed."""
    ranks = {bytes([b]): b for b in range(256)} | {b"aa": 256, b"aaa": 257}
    out = convert_ranks(ranks, LLAMA3_PATTERN, [], tmp_path / "tokenizer.json")
    described = json.loads(out.read_text())
    described["model"]["merges"] = [m for m in described["model"]["merges"] if m != ["aa", "a"]]
    tokenizer = Tokenizer.from_str(json.dumps(described))
    with pytest.raises(NotProven, match="makes its token 'aaa' of 'aa' \\+ 'a'"):
        FastBPE.from_description(described, proven=True)
    for text in ("aaaaa", "baaa"):
        assert _tiktoken_ids(tokenizer, [text]) != _ids(tokenizer, [text])
