"""Byte-level BPE tokenizers shaped as GPT-2's and Llama 3's: trained by `tokenizers` itself,
built by `tokenizers` from merges given by hand (adversarial ones), or converted from a
tiktoken rank table by `transformers`' own converter, as Llama 3's and Qwen's files are."""

from __future__ import annotations

import base64
import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

from hp_data.fast_bpe import LLAMA3_PATTERN
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers


def with_merges(merges: Sequence[tuple[str, str]], llama3: bool = False) -> Tokenizer:
    """Every byte, then exactly `merges` in rank order (tokens written as byte-level
    characters, "Ġ" for a space), laid out as GPT-2's (ByteLevel with its regex) or, with
    `llama3`, as Llama 3's (`LLAMA3_PATTERN`, ByteLevel without a regex, ignore_merges on)."""
    vocab = {
        char: number for number, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))
    }
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), ignore_merges=llama3))
    tokenizer.pre_tokenizer = (
        _llama3_split() if llama3 else pre_tokenizers.ByteLevel(add_prefix_space=False)
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def corpus_texts(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]


def train_gpt2_style(texts: list[str], out: Path, vocab_size: int = 4000) -> Path:
    """ByteLevel pre-tokenizer with its own regex, merges applied in full (ignore_merges off),
    one added token `<|endoftext|>`: GPT-2's layout."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(out))
    return out


def train_llama3_style(texts: list[str], out: Path, vocab_size: int = 100_000) -> Path:
    """Llama 3's layout: a Split with Llama 3's regex, then ByteLevel without a regex,
    ignore_merges on, 256 added special tokens. The example corpus alone has too few words
    for 100k merges, so made-up words (Latin syllables, CJK) are added to it."""
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiouy"]
    syllables += list("的一是不了人我在有他")
    made_up = [
        " ".join("".join(rng.choices(syllables, k=rng.randint(1, 6))) for _ in range(200))
        for _ in range(500)
    ]
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = _llama3_split()
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(254)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts + made_up, trainer=trainer)
    tokenizer.save(str(out))
    return out


def rank_table(trained: Path) -> dict[bytes, int]:
    """A tiktoken rank table out of a trained byte-level tokenizer.json: its tokens' bytes, in
    the order the trainer made them (added tokens left out), as tiktoken's own files hold it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    described = json.loads(trained.read_text(encoding="utf-8"))
    added = {token["id"] for token in described["added_tokens"]}
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    tokens = sorted((n, t) for t, n in described["model"]["vocab"].items() if n not in added)
    return {bytes(to_byte[c] for c in token): rank for rank, (_, token) in enumerate(tokens)}


def convert_ranks(
    ranks: Mapping[bytes, int], pattern: str, specials: Sequence[str], out: Path
) -> Path:
    """`ranks` written as a `.tiktoken` file and turned into a tokenizer.json by transformers'
    `TikTokenConverter` (every two-token split of a token a merge, ignore_merges on, the
    split regex then ByteLevel): the tokenizer a user of Llama 3 or Qwen downloads."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    lines = "".join(f"{base64.b64encode(t).decode()} {rank}\n" for t, rank in ranks.items())
    # Named by its content: tiktoken caches what it read under the path's name.
    table = out.with_name(f"{out.stem}-{hashlib.sha256(lines.encode()).hexdigest()[:16]}.tiktoken")
    table.write_text(lines, encoding="ascii")
    converter = TikTokenConverter(
        vocab_file=str(table), pattern=pattern, extra_special_tokens=list(specials)
    )
    converter.converted().save(str(out))
    return out


def adversarial_probes(count: int = 3200, seed: int = 1) -> list[str]:
    """Texts where converted tokenizers' many merges of one token could tell the engines apart:
    long digit runs, mixed scripts, emoji (with joiners and skin tones), whitespace runs,
    contractions, repeated characters and repeated syllables."""
    rng = random.Random(seed)
    scripts = "aéßΩжשع अ ก 한あア中🙂👍🏽👨‍👩‍👧ﬁ\u0301\u200d"
    syllables = ["an", "na", "ana", "ss", "is", "si", "ab", "ba", "ing", "the", "er", "re"]

    def piece() -> str:
        kind = rng.randrange(7)
        if kind == 0:
            return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 40)))
        if kind == 1:
            return "".join(rng.choice(scripts) for _ in range(rng.randint(1, 12)))
        if kind == 2:
            return "".join(rng.choice(" \t\n\r\u00a0\u3000") for _ in range(rng.randint(1, 30)))
        if kind == 3:
            return rng.choice(["I", "you", "WE", "it", "They"]) + rng.choice(_CONTRACTIONS_ALL)
        if kind == 4:
            return rng.choice("a -=*#.0e/") * rng.randint(2, 70)
        if kind == 5:
            return "".join(rng.choices(syllables, k=rng.randint(2, 14)))
        return rng.choice(["Hello", "WORLD", "camelCase", "snake_case", "x1y22", "3.14159"])

    return ["".join(piece() for _ in range(rng.randint(1, 6))) for _ in range(count)]


_CONTRACTIONS_ALL = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'Re", "\u2019s"]
