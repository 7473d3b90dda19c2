"""What a dataset's two Megatron files cannot say: how its tokens were made.

`PREFIX.hp.json` sits beside `PREFIX.bin` and `PREFIX.idx`; Megatron ignores it. hp's
builder writes it in the same atomic commit as the two files (`format/commit.py`), and
removes it there when it rewrites the prefix without one, so it never describes other tokens
than the ones beside it. It records the tokenizer (what was named, the files used, their
xxh3-128), so that `inspect --show` decodes without being told, and the EOD and BOS ids.
`max_token_id` (the largest id in the `.bin`, null when it holds none; absent when the writer
did not see every token) and `vocab_size` (the tokenizer's) let a trainer check its embedding
without reading the corpus; readers ignore keys they do not know, so the schema stays 1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from hp_data.errors import IndexedDatasetError
from hp_data.format.commit import recover
from hp_data.format.header import metadata_path, prefix_of

SCHEMA = 1


def read_metadata(prefix: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The metadata of the dataset at `prefix`, or None when it has none (Megatron's own
    files, or hp's written without a tokenizer)."""
    recover(prefix_of(prefix))  # a commit a kill interrupted is finished before reading
    path = metadata_path(prefix)
    try:
        with open(path, encoding="utf-8") as stream:
            metadata = json.load(stream)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as exc:
        raise IndexedDatasetError(f"{path}: not valid JSON ({exc}); delete it") from None
    schema = metadata.get("schema") if isinstance(metadata, dict) else None
    if not isinstance(schema, int):
        raise IndexedDatasetError(f"{path}: no integer 'schema' key; delete it")
    if schema > SCHEMA:
        raise IndexedDatasetError(
            f"{path}: schema {schema} is newer than this hp-data reads ({SCHEMA}); upgrade hp-data"
        )
    return metadata


def shared_metadata(prefixes: Sequence[str]) -> dict[str, Any] | None:
    """The metadata for a concatenation of `prefixes`: the first's, when every one records
    the same tokenizer bytes and EOD and BOS ids; otherwise None, as nothing true can be said.
    Its `max_token_id` is the largest of the inputs' (null: no token), and absent unless every
    input has the key.
    """
    found = [read_metadata(prefix) for prefix in prefixes]
    if not found or any(m is None for m in found):
        return None
    made = {
        (m.get("tokenizer", {}).get("xxh3_128"), m.get("eod"), m.get("bos"))
        for m in found  # type: ignore[union-attr]
    }
    if len(made) != 1:
        return None
    shared = {k: v for k, v in found[0].items() if k != "max_token_id"}  # type: ignore[union-attr]
    if all("max_token_id" in m for m in found):  # type: ignore[operator]
        largest = [m["max_token_id"] for m in found if m["max_token_id"] is not None]  # type: ignore[index]
        shared["max_token_id"] = max(largest, default=None)
    return shared
