"""A faster exact engine for byte-level BPE: `tiktoken` built from a tokenizer.json's own
vocabulary, merges and split pattern, and the proof that it gives `tokenizers`' ids.

`tiktoken` and `tokenizers` run the same algorithm on byte-level BPE (split the text on added
tokens, then with a regex, then join a piece's adjacent tokens pair by pair, lowest key first,
leftmost on a tie). They differ in what a key is attached to: `tokenizers` ranks merges
(pairs), `tiktoken` ranks the joined bytes, and `tiktoken` emits a piece that is itself a token
whole (what `tokenizers` calls `ignore_merges`). The conversion keeps only tokenizers it can
map (byte-level merges whose tokens are in the vocab, the merges that make one token next to
each other in the list, no normalizer, no prefix space, added tokens matched literally): a
token's rank is where its first merge stands, so both engines order the joins of different
tokens alike. It says why it refuses the rest.

Why one more condition makes the merging exact (`prove`). A token may be made by one merge
(as `tokenizers`' trainer writes them) or by several (a vocabulary converted from tiktoken's
ranks lists every two-token split of a token). Either way, look at `tiktoken` joining two
adjacent tokens x, y into t in some piece. Nothing ever joined across the edges of x and y,
so the joins inside t's bytes were made in the order `tiktoken` makes them on t's bytes alone
(each was the lowest key of the piece when made, so the lowest among t's bytes; the edges
shift every position alike). `tiktoken` alone on t's bytes passes through one two-token state
at most: so every pair that `tiktoken` ever joins into t, anywhere, is that one split x + y,
t's own. Hence if t's own split is one of `tokenizers`' merges, for every t that `tiktoken`
makes of its own bytes, the engines never part: at each step `tokenizers`' pairs are among
`tiktoken`'s (its merges make tokens), `tiktoken`'s lowest are all one merge of one token,
which `tokenizers` ranks lowest too (a token's merges stand together), and both take the
leftmost. Without `ignore_merges` a piece that is a token t is emitted whole by `tiktoken`
and merged by `tokenizers`, which then needs `tiktoken` alone on t's bytes to make t. The
two engines' ties between two merges of one token (`tokenizers` orders them by their place
in the list, `tiktoken` by position) never arise, since only t's own split is ever joined.
`prove` runs `tiktoken`'s merging on every token's bytes, but for a token each of whose splits
into two tokens is a merge (a converted file's tokens): its own split is one of them.
The split regex is given to both (to `tiktoken` made to keep the text between matches, as
`tokenizers` does, `_keeping_gaps`); what no proof here covers, the two regex engines' dialects,
is checked by comparing ids: on a probe set before a run, and on sampled documents during it.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import orjson

# The split regex of tokenizers' ByteLevel pre-tokenizer with use_regex=true (GPT-2's).
BYTE_LEVEL_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's split regex, as its tokenizer.json gives it.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The split regex of tiktoken's o200k_base (GPT-4o; cased words, marks kept with letters).
O200K_PATTERN = "|".join(
    (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)
# What a recipe saved by an older proof must not be taken for (`FastBPE.load`): bumped
# whenever `prove` or the conversion changes.
PROOF_VERSION = 2
# Split regexes that match at every position of any text: each character is a letter, a
# number, a space or none of these, and an alternative takes each kind on its own.
COVERING_PATTERNS = frozenset((BYTE_LEVEL_PATTERN, LLAMA3_PATTERN, O200K_PATTERN))


class NotConvertible(Exception):
    """The tokenizer is not one the fast engine reproduces exactly; the message says why."""


class NotProven(NotConvertible):
    """The tokenizer converts, but `prove` finds a token the two engines can reach apart."""


@functools.cache
def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map, in which byte-level vocabularies are written:
    `_byte_chars()[b]` stands for byte b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + len(chars) - len(printable)
    return [chr(chars[b]) for b in range(256)]


def _as_bytes(token: str) -> bytes | None:
    """The bytes a byte-level token stands for; None if it is not one."""
    try:
        return token.translate(_to_latin1()).encode("latin-1")
    except UnicodeEncodeError:
        return None


@functools.cache
def _to_latin1() -> dict[int, int]:
    # Each byte's character -> the Latin-1 character of that byte; a character below U+0100
    # that stands for no byte -> one that Latin-1 cannot encode, so that it is refused.
    table = {c: 0xFFFF for c in range(256)}
    table.update({ord(char): byte for byte, char in enumerate(_byte_chars())})
    return table


@dataclass(frozen=True)
class FastBPE:
    """The recipe for the `tiktoken` engine, built once per process: a worker converts the
    tokenizer again rather than receive it, so that its start-up data stays small."""

    pattern: str
    ranks: dict[bytes, int]  # mergeable bytes -> rank (merge priority)
    specials: dict[str, int]  # added token text -> rank
    ids: np.ndarray  # rank -> the tokenizer's id

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike[str]) -> FastBPE:
        with open(path, "rb") as stream:
            return cls.from_description(orjson.loads(stream.read()))

    @classmethod
    def from_description(cls, described: dict[str, Any], proven: bool = False) -> FastBPE:
        """Convert a parsed tokenizer.json, or raise `NotConvertible`; with `proven`, also
        unless `prove` shows the merging exact (once per run: workers skip it)."""
        for option in ("truncation", "padding"):
            if described.get(option):
                raise NotConvertible(f"it sets {option}")
        normalizer = described.get("normalizer")
        if normalizer and not (
            normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")
        ):
            raise NotConvertible(f"its normalizer ({normalizer.get('type')}) changes the text")
        pattern = _pattern(described.get("pre_tokenizer"))
        model = described.get("model") or {}
        if model.get("type") != "BPE":
            raise NotConvertible(f"its model is {model.get('type')}, not BPE")
        if model.get("dropout"):
            raise NotConvertible("its BPE uses dropout")
        if model.get("byte_fallback"):
            raise NotConvertible("its BPE uses byte_fallback")
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise NotConvertible("its BPE marks subwords (prefix or suffix)")
        vocab: dict[str, int] = model.get("vocab") or {}
        added = described.get("added_tokens") or []
        merges = _pairs(model.get("merges") or [])
        recipe = cls._build(pattern, vocab, merges, added, model)
        if proven:
            prove(merges, recipe, whole_pieces=bool(model.get("ignore_merges")))
        return recipe

    @classmethod
    def _build(
        cls,
        pattern: str,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        added: Sequence[dict[str, Any]],
        model: dict[str, Any],
    ) -> FastBPE:
        as_bytes = {token: _as_bytes(token) for token in vocab}
        ranks: dict[bytes, int] = {}
        ids: list[int] = []
        for byte, char in enumerate(_byte_chars()):
            if char not in vocab:
                raise NotConvertible(f"byte {byte} has no token")
            ranks[bytes([byte])] = len(ids)
            ids.append(vocab[char])
        previous = None
        for number, (left, right) in enumerate(merges):
            made = left + right
            if made == previous:  # another merge of the token just ranked (converted files)
                continue
            if made not in vocab:
                raise NotConvertible(f"merge {number} makes {made!r}, which is not in the vocab")
            first, second = as_bytes.get(left), as_bytes.get(right)
            if first is None or second is None:
                raise NotConvertible(f"merge {number} joins tokens that are not byte-level")
            key = first + second
            if key in ranks:
                raise NotConvertible(
                    f"merge {number} makes {made!r}, which a merge apart from it made earlier"
                )
            ranks[key] = len(ids)  # a token's rank: where its first merge stands
            ids.append(vocab[made])
            previous = made
        added_ids = set()
        specials: dict[str, int] = {}
        for token in added:
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
                raise NotConvertible(f"its added token {token['content']!r} strips or is single")
            specials[token["content"]] = len(ids)
            ids.append(token["id"])
            added_ids.add(token["id"])
        contents = sorted(specials)
        for shorter, longer in itertools.pairwise(contents):
            if longer.startswith(shorter):
                raise NotConvertible(f"its added token {shorter!r} begins {longer!r}")
        if model.get("ignore_merges"):
            # tokenizers then emits any whole piece found in the vocab, as tiktoken does.
            for token, number in vocab.items():
                if number in added_ids:
                    continue
                key = as_bytes[token]
                if key is None:
                    raise NotConvertible(f"its token {token!r} is not byte-level")
                if key not in ranks:
                    ranks[key] = len(ids)
                    ids.append(number)
        return cls(pattern, ranks, specials, np.asarray(ids, dtype=np.int64))

    def engine(self) -> TiktokenEngine:
        return TiktokenEngine(self)

    def save(self, stream: IO[bytes], tokenizer_hash: str) -> None:
        """The recipe as an uncompressed .npz (no pickle; zip's CRC guards every member),
        marked with the xxh3-128 of the tokenizer.json it was made from and the proof's
        version, which `load` checks: a later run reads it instead of converting again."""
        keys = list(self.ranks)
        meta = {"pattern": self.pattern, "specials": self.specials, "tokenizer": tokenizer_hash}
        np.savez(
            stream,
            meta=np.frombuffer(orjson.dumps({**meta, "proof": PROOF_VERSION}), np.uint8),
            blob=np.frombuffer(b"".join(keys), np.uint8),
            ends=np.cumsum([len(key) for key in keys], dtype=np.int64),
            order=np.fromiter(self.ranks.values(), np.int64, count=len(keys)),
            ids=self.ids,
        )

    @classmethod
    def load(cls, path: str, tokenizer_hash: str) -> FastBPE:
        """What `save` wrote for the tokenizer whose xxh3-128 is `tokenizer_hash`; raises
        ValueError (or OSError) for anything else: another tokenizer's, another proof's,
        damaged, not a recipe."""
        try:
            with np.load(path, allow_pickle=False) as arrays:
                meta = orjson.loads(arrays["meta"].tobytes())
                blob, ends = arrays["blob"].tobytes(), arrays["ends"].tolist()
                order, ids = arrays["order"].tolist(), arrays["ids"]
        except (KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(f"not a recipe: {exc}") from None
        if not isinstance(meta, dict) or (meta.get("tokenizer"), meta.get("proof")) != (
            tokenizer_hash,
            PROOF_VERSION,
        ):
            raise ValueError("a recipe of another tokenizer or proof")
        starts = [0, *ends[:-1]]
        ranks = {blob[a:b]: rank for a, b, rank in zip(starts, ends, order, strict=True)}
        if len(ranks) != len(order) or ids.dtype != np.int64 or len(ids) <= max(order, default=0):
            raise ValueError("an inconsistent recipe")
        return cls(meta["pattern"], ranks, meta["specials"], ids)


def _pairs(merges: Sequence[Any]) -> list[tuple[str, str]]:
    """A tokenizer.json's merges as (left, right), from either of its spellings."""
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def prove(merges: list[tuple[str, str]], recipe: FastBPE, whole_pieces: bool) -> None:
    """Raise `NotProven` unless every token that `tiktoken` makes of its own bytes (`recipe`'s,
    converted with `merges`) comes out of one of `tokenizers`' merges, its own split; and,
    unless `tokenizers` emits whole pieces too (`whole_pieces`: `ignore_merges`), unless
    `tiktoken` makes every token so. The condition under which the two merge alike (the module
    docstring says why)."""
    as_bytes = {side: _as_bytes(side) for side in {side for pair in merges for side in pair}}
    pairs = {(as_bytes[left], as_bytes[right]) for left, right in merges}
    ranks = recipe.ranks
    for token in itertools.islice(ranks, 256, None):
        if whole_pieces and _every_split_merges(token, ranks, pairs):
            continue  # its own split, whichever it is, is a merge (a converted file's case)
        split = _own_split(token, ranks)
        if split is None and not whole_pieces:
            raise NotProven(
                f"tiktoken does not make its token {_as_text(token)!r} of its bytes, but emits "
                "a piece that is this token whole, where tokenizers merges its bytes"
            )
        if split is not None and split not in pairs:
            parts = " + ".join(repr(_as_text(part)) for part in split)
            raise NotProven(
                f"tiktoken makes its token {_as_text(token)!r} of {parts}, which is not one of "
                "its merges, so the engines can part"
            )


def _every_split_merges(
    token: bytes, ranks: dict[bytes, int], pairs: set[tuple[bytes | None, bytes | None]]
) -> bool:
    """Whether every split of `token` into two tokens is a merge: then so is its own split,
    if tiktoken makes it at all, without running tiktoken's merging to find which."""
    for i in range(1, len(token)):
        left, right = token[:i], token[i:]
        if left in ranks and right in ranks and (left, right) not in pairs:
            return False
    return True


def _own_split(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two tokens `tiktoken` joins into `token` when it merges `token`'s bytes alone
    (lowest rank first, leftmost on a tie), or None if it does not make `token`."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = None, 0
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _as_text(key: bytes) -> str:
    """The byte-level token that stands for `key` (`_as_bytes` undone)."""
    chars = _byte_chars()
    return "".join(chars[byte] for byte in key)


def _pattern(pre_tokenizer: dict[str, Any] | None) -> str:
    """tiktoken's split regex for a pre-tokenizer: ByteLevel with its regex, or a Split
    (Isolated) regex followed by a ByteLevel without one (as in Llama 3)."""
    if not pre_tokenizer:
        raise NotConvertible("it has no pre-tokenizer")
    steps = (
        pre_tokenizer.get("pretokenizers") or []
        if pre_tokenizer.get("type") == "Sequence"
        else [pre_tokenizer]
    )
    kinds = [step.get("type") for step in steps]
    if not steps or kinds[-1] != "ByteLevel" or len(steps) > 2:
        raise NotConvertible(f"its pre-tokenizer ({' + '.join(map(str, kinds))}) is not ByteLevel")
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        raise NotConvertible("its ByteLevel adds a prefix space")
    if len(steps) == 1:
        if not byte_level.get("use_regex", True):
            raise NotConvertible("its ByteLevel splits with no regex")
        return BYTE_LEVEL_PATTERN
    split = steps[0]
    if kinds[0] != "Split" or byte_level.get("use_regex", True):
        raise NotConvertible(f"its pre-tokenizer ({' + '.join(map(str, kinds))}) is not one regex")
    regex = (split.get("pattern") or {}).get("Regex")
    if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
        raise NotConvertible("its Split is not an isolating regex")
    if re.search(r"\\[1-9]|\\k<", regex):  # _keeping_gaps repeats it: numbers would shift
        raise NotConvertible("its Split regex uses a backreference")
    if regex not in COVERING_PATTERNS and _matches_empty(regex):
        raise NotConvertible("its Split regex can match the empty string")
    return regex if regex in COVERING_PATTERNS else _keeping_gaps(regex)


def _matches_empty(pattern: str) -> bool:
    """Whether `pattern` matches the empty string at the start or end of a text, or between
    two characters of a few kinds: there an empty match wins over `_keeping_gaps`' gap, and
    tiktoken would drop what `tokenizers` keeps. (A pattern that tiktoken's regex engine
    cannot parse is left to the checks against `tokenizers`.)"""
    import regex as third_party  # tiktoken's own dependency; \p{L} needs it

    try:
        compiled = third_party.compile(pattern)
    except third_party.error:
        return False
    texts = ("", "a", " ", "1", "\n", "!", "é", "中", "a b", "a1!\n é")
    return any(m.start() == m.end() for text in texts for m in compiled.finditer(text))


def _keeping_gaps(regex: str) -> str:
    """`regex` for tiktoken, which drops the text between matches where `tokenizers` keeps each
    such gap as a piece: a second alternative takes a gap, a run of characters at none of
    which `regex` matches, and ends where `tokenizers`' next match starts. (Not needed for
    `COVERING_PATTERNS`, and a few percent slower.)"""
    return f"(?:{regex})|(?:(?!(?:{regex}))[\\s\\S])+"


class TiktokenEngine:
    """Token ids of texts, through `tiktoken`, in the tokenizer's own numbering."""

    name = "tiktoken"

    def __init__(self, recipe: FastBPE) -> None:
        import tiktoken

        self.encoding = tiktoken.Encoding(
            "hp-fast-bpe",
            pat_str=recipe.pattern,
            mergeable_ranks=recipe.ranks,
            special_tokens=recipe.specials,
        )
        self.allowed = frozenset(recipe.specials)
        self.ids = recipe.ids

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids of all texts back to back, each text's count). A text that is not valid
        Unicode (a lone surrogate) raises UnicodeEncodeError, as `tokenizers` refuses it."""
        encode = functools.partial(self.encoding.encode_to_numpy, allowed_special=self.allowed)
        parts = [encode(text) for text in texts]
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        ranks = np.concatenate(parts) if parts else np.empty(0, np.uint32)
        return self.ids[ranks], lengths


# -- the probe set ----------------------------------------------------------------------------

_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ll", "'D")
_SPACES = (" ", "  ", "\t", "\n", "\r\n", "\n\n", " \n", "\u00a0", "\u3000", "\u2009", "\x0b")


def probe_texts(added: Sequence[str] = (), seed: int = 0) -> list[str]:
    """Texts that reach the corners where two BPE engines could part: every character below
    U+0100 alone and in words, random Unicode (combining marks, CJK, emoji, other scripts),
    runs of whitespace and digits, contractions, and the tokenizer's added tokens in text."""
    texts = list(_general_probes(seed))
    for token in added:
        texts += [token, f"a{token}b", f" {token} ", f"{token}{token}", f"x {token}\n{token}"]
    return texts


@functools.lru_cache(maxsize=1)
def _general_probes(seed: int) -> tuple[str, ...]:
    """The probes every tokenizer gets, drawn once a process (a run that preprocesses again,
    a worker that takes many tasks, pays for them once)."""
    rng = random.Random(seed)
    texts = [chr(c) for c in range(256)]
    texts += ["a" + chr(c) + "b " + chr(c) * 3 for c in range(256)]
    blocks = [
        (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF),
        (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F),
        (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF),
        (0x10000, 0x1007F), (0xFE00, 0xFE0F), (0x1D400, 0x1D7FF),
    ]  # fmt: skip

    def char() -> str:
        low, high = rng.choice(blocks)
        return chr(rng.randint(low, high))

    def word() -> str:
        kind = rng.random()
        if kind < 0.3:
            return "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEZ") for _ in range(8))[
                : rng.randint(1, 8)
            ]
        if kind < 0.45:
            return str(rng.randint(0, 10 ** rng.randint(1, 12)))
        if kind < 0.55:
            return rng.choice(_CONTRACTIONS)
        if kind < 0.7:
            return rng.choice(_SPACES) * rng.randint(1, 4)
        return "".join(char() for _ in range(rng.randint(1, 5)))

    for _ in range(1000):
        texts.append("".join(word() + rng.choice(("", " ", " ", "\n")) for _ in range(12)))
    for contraction in _CONTRACTIONS:
        texts += [f"it{contraction} x", f"I{contraction}{contraction}", f" {contraction}"]
    for space in _SPACES:
        texts += [space * n + "x" + space * n for n in (1, 2, 5)] + [space * 7]
    texts += ["0", "12", "123", "1234", "12345678901234567890", "3.14159", "1,000,000", "x1y22"]
    return tuple(texts)


@dataclass(frozen=True)
class Mismatch:
    """Where two engines first part on a text."""

    index: int  # of the text in the batch
    position: int  # of the first different id
    expected: list[int]  # tokenizers' ids around there
    got: list[int]

    def describe(self) -> str:
        return f"at token {self.position}, tokenizers gives {self.expected} and tiktoken {self.got}"


def compare(
    texts: Sequence[str],
    want: tuple[np.ndarray, np.ndarray],
    got: tuple[np.ndarray, np.ndarray],
) -> Mismatch | None:
    """The first of `texts` whose ids differ between `want` and `got` (each: ids back to
    back, and each text's count), or None."""
    (want_ids, want_lengths), (got_ids, got_lengths) = want, got
    if np.array_equal(want_lengths, got_lengths) and np.array_equal(want_ids, got_ids):
        return None
    want_ends, got_ends = np.cumsum(want_lengths), np.cumsum(got_lengths)
    for index in range(len(texts)):
        a = want_ids[want_ends[index] - want_lengths[index] : want_ends[index]]
        b = got_ids[got_ends[index] - got_lengths[index] : got_ends[index]]
        if not np.array_equal(a, b):
            common = min(len(a), len(b))
            differs = np.flatnonzero(a[:common] != b[:common])
            position = int(differs[0]) if len(differs) else common
            window = slice(position, position + 3)
            return Mismatch(index, position, a[window].tolist(), b[window].tolist())
    raise AssertionError("the batches differ but no text does")  # pragma: no cover


def pick(ids: np.ndarray, lengths: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids and counts of the `chosen` texts out of a batch's (ids, lengths)."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    parts = [ids[starts[i] : ends[i]] for i in chosen]
    return (np.concatenate(parts) if parts else ids[:0]), lengths[chosen]
