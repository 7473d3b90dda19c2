"""The proven tiktoken recipe of a tokenizer, kept on disk under the tokenizer's content hash.

Converting a 128k tokenizer that was itself converted from tiktoken and proving it exact
(`fast_bpe.prove`) takes about 1.3 s, a third of a 50 MB run, and converting it again in each
worker 0.6 s (2026-12-05). Both depend on the tokenizer.json bytes alone, so the proven recipe is
kept under their xxh3-128 and the proof's version, in the user's cache (`HP_DATA_TOKENIZER_CACHE`,
else `$XDG_CACHE_HOME/hp-data/tokenizers`, else `~/.cache/hp-data/tokenizers`; `off` keeps
nothing), and read back by later runs, by every worker of a run and by every shard of a split
run. Only proven recipes are kept: a tokenizer the proof refuses is refused again, with its
reason, on each run. A file that does not load (damaged, another tokenizer's, an older proof's)
is made again; a directory that cannot be written keeps nothing and the run goes on. Whatever a
kept recipe gives is still checked against `tokenizers` on the probe set before every run and
on sampled documents during it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hp_data.fast_bpe import PROOF_VERSION, FastBPE
from hp_data.fs import can_write_in, committing

ENV = "HP_DATA_TOKENIZER_CACHE"


def cache_dir() -> str | None:
    """Where proven recipes are kept; None when `HP_DATA_TOKENIZER_CACHE=off`."""
    configured = os.environ.get(ENV)
    if configured == "off":
        return None
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hp-data", "tokenizers")


def recipe_path(tokenizer_hash: str) -> str | None:
    """The file that holds (or would hold) the proven recipe of this tokenizer."""
    directory = cache_dir()
    if directory is None:
        return None
    return os.path.join(directory, f"{tokenizer_hash}-proof{PROOF_VERSION}.npz")


def load(path: str | None, tokenizer_hash: str) -> FastBPE | None:
    """The recipe kept at `path` for this tokenizer, or None (no file, or one that does not
    load as this tokenizer's: it is then made again)."""
    if path is None or not os.path.isfile(path):
        return None
    try:
        return FastBPE.load(path, tokenizer_hash)
    except Exception:  # whatever a damaged zip raises (zlib, struct, zipfile, numpy): remake
        return None


def proven_recipe(
    convert: Callable[[], FastBPE], tokenizer_hash: str
) -> tuple[FastBPE, str | None]:
    """The tokenizer's proven recipe, kept or made by `convert` (converts and proves, raising
    `NotConvertible`), and the file that now holds it for the run's workers (None: none)."""
    path = recipe_path(tokenizer_hash)
    kept = load(path, tokenizer_hash)
    if kept is not None:
        return kept, path
    recipe = convert()
    if path is None or not can_write_in(os.path.dirname(path)):
        return recipe, None
    try:
        with committing(path, durable=False) as stream:
            recipe.save(stream, tokenizer_hash)
    except OSError:
        return recipe, None
    return recipe, path
