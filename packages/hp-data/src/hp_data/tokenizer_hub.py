"""A tokenizer named by its Hugging Face hub name: its files in the hub's cache, fetched
when allowed, a damaged cached copy fetched again or refused."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Iterator

from hp_data.errors import PreprocessError
from hp_data.fs import first_line

# What a tokenizer is fetched as from the Hugging Face hub (never weights).
HUB_FILES = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _from_hub(name: str, allow_download: bool) -> str:
    """The directory of `name`'s tokenizer files in the Hugging Face cache (HF_HOME,
    HF_HUB_CACHE), fetched first if `allow_download`; a cached file whose bytes are not the
    hub's (its blob name is their hash) is fetched again once, or refused."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    missing = (
        f"{name}: the Hugging Face hub ({constants.ENDPOINT}) has no model repository of that "
        "name (a private or gated one needs a token: hf auth login)"
    )
    try:
        with _hub_notices_dropped():
            folder = snapshot_download(
                name, allow_patterns=HUB_FILES, local_files_only=not allow_download
            )
    except LocalEntryNotFoundError as exc:
        if not allow_download:
            raise PreprocessError(
                f"{name}: no such file or directory, and not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}); fetch it with --allow-download"
            ) from None
        cause = exc.__cause__
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if status in (401, 403, 404):  # the hub answered: there is no such repository
            raise PreprocessError(missing) from None
        why = f": {first_line(cause)}" if cause is not None else ""
        raise PreprocessError(
            f"{name}: could not reach the Hugging Face hub ({constants.ENDPOINT}){why}"
        ) from None
    except RepositoryNotFoundError:
        raise PreprocessError(missing) from None
    except (HfHubHTTPError, ValueError, OSError) as exc:
        raise PreprocessError(f"{name}: {first_line(exc)}") from None
    for file in _damaged(folder):
        if not allow_download:
            raise PreprocessError(
                f"{name}: the cached copy at {file} is damaged (its bytes are not the hub's); "
                "fetch it again with --allow-download"
            )
        try:
            revision = os.path.basename(folder)
            hf_hub_download(name, os.path.basename(file), revision=revision, force_download=True)
        except (HfHubHTTPError, ValueError, OSError) as exc:
            raise PreprocessError(
                f"{name}: the cached copy at {file} is damaged, and fetching it again failed: "
                f"{first_line(exc)}"
            ) from None
        if file in _damaged(folder):
            raise PreprocessError(f"{name}: {file} is damaged even as fetched again")
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    if "tokenizer.json" not in names and not {"vocab.json", "merges.txt"} <= names:
        raise PreprocessError(
            f"{name}: the Hugging Face hub repository has no tokenizer.json (nor vocab.json "
            "and merges.txt)" + ("" if allow_download else "; fetch it with --allow-download")
        )
    return folder


def _damaged(folder: str) -> list[str]:
    """The files of a hub cache snapshot whose bytes do not hash to the blob they link to
    (named by the hub's ETag: sha256 for large files, the git blob sha1 for others)."""
    damaged = []
    for name in HUB_FILES:
        path = os.path.join(folder, name)
        blob = os.path.realpath(path)
        if not os.path.isfile(path) or os.path.basename(os.path.dirname(blob)) != "blobs":
            continue  # not there, or not a link into the cache's blobs: nothing to hold it to
        with open(blob, "rb") as stream:
            data = stream.read()
        expected = os.path.basename(blob)
        if len(expected) == 64:
            found = hashlib.sha256(data).hexdigest()
        elif len(expected) == 40:
            found = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
        else:
            continue
        if found != expected:
            damaged.append(path)
    return damaged


@contextlib.contextmanager
def _hub_notices_dropped() -> Iterator[None]:
    """huggingface_hub's "No files matched allow_patterns" notice, dropped: a repository
    without tokenizer files is said in hp's one line (and it printed even under --quiet)."""
    logger = logging.getLogger("huggingface_hub._snapshot_download")

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No files matched")

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
