"""How checkpoint files are written and read: checksums taken while DCP writes, verified while
it reads, and nothing unpickled that is not plain checkpoint data.

- **Checksums.** DCP writes each tensor (or byte blob) of a shard file through a stream that
  hp hands it; that stream hashes the bytes on their way to disk (xxh3-64, no second pass) and
  the digest lands in DCP's `.metadata` beside the item's offset and length. Reading, DCP
  passes each item's bytes through hp's check before `torch.load` sees them, so a flipped byte
  is found in exactly the items a rank reads, on any layout, and named by file and tensor.
  Checkpoints written before this carry no digests and load unchecked.
- **No code from a checkpoint.** DCP's `.metadata` is a pickle; `read_metadata` unpickles it
  with a loader that admits only DCP's metadata types and the few torch and builtin types they
  use, and refuses anything else by name. hp's own files are JSON with a checksum of their own
  (`write_json` / `read_json`); tensors and the byte items DCP saves for the optimizer's
  hyperparameters are read with `torch.load(weights_only=True)` (`SafeLoadPlanner`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch
import xxhash
from hp_data import fs
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.filesystem import (
    _StorageReaderTransforms,
    _StorageWriterTransforms,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

CHECKSUM = "hp_xxh3"  # the attribute of an item's storage record that holds its digest
CHECKSUM_KEY = "xxh3"  # the field a JSON file's own checksum is kept in


class Damaged(ValueError):
    """A checkpoint file whose bytes are not the ones written; the message names it."""


class _HashingWriter(io.RawIOBase):
    """Passes writes through to `raw` (which it never closes: DCP writes every item of a shard
    into one file) and, on close, files the digest of what passed under the item's index."""

    def __init__(self, raw: IO[bytes], digests: dict[Any, str], index: Any) -> None:
        super().__init__()
        self.raw, self.digests, self.index = raw, digests, index
        self.hasher = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.hasher.update(data)
        self.raw.write(data)
        return memoryview(data).nbytes

    def close(self) -> None:
        if not self.closed:
            self.digests[self.index] = self.hasher.hexdigest()
        super().close()


class _ChecksumTransforms(_StorageWriterTransforms):
    """The one output "transform" hp uses: it changes no byte, it only hashes them."""

    def __init__(self, digests: dict[Any, str]) -> None:
        super().__init__(None)
        self.digests = digests

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> tuple[Any, list[str]]:
        return _HashingWriter(raw_stream, self.digests, write_item.index), []


class ChecksumWriter(FileSystemWriter):
    """DCP's file writer with each item's checksum taken on the way. The digest rides on the
    item's storage record (`_StorageInfo`) as one more attribute, pickled into `.metadata`
    with it; DCP's own reader ignores it, so plain `dcp.load` still reads hp's checkpoints."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.digests: dict[Any, str] = {}
        self.transforms = _ChecksumTransforms(self.digests)

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)  # written by now (DCP's writer is eager)
        for result in future.wait():
            setattr(result.storage_data, CHECKSUM, self.digests.pop(result.index))
        return future


class _VerifyingTransforms(_StorageReaderTransforms):
    def __init__(self, reader: CheckedReader) -> None:
        super().__init__(None)
        self.reader = reader

    def transform_load_stream(
        self, read_item: Any, transform_descriptors: Sequence[str], raw_stream: IO[bytes]
    ) -> IO[bytes]:
        stream = super().transform_load_stream(read_item, transform_descriptors, raw_stream)
        info = self.reader.storage_data[read_item.storage_index]
        expected = getattr(info, CHECKSUM, None)
        if expected is None:  # written before checksums
            return stream
        data = stream.read()
        if xxhash.xxh3_64_hexdigest(data) != expected:
            where = os.path.join(str(self.reader.path), info.relative_path)
            raise Damaged(f"{where}: {read_item.storage_index.fqn} fails its checksum")
        return io.BytesIO(data)


# What a DCP `.metadata` pickle may name (torch 2.4 - 2.15 write these and nothing else).
_METADATA_TYPES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream: IO[bytes], path: str) -> None:
        super().__init__(stream)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_TYPES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise Damaged(f"{self.path}: refers to {module}.{name}, which a checkpoint never holds")


def read_metadata_file(path: str) -> Metadata:
    """DCP's `.metadata` at `path`, unpickled without running anything from it."""
    with open(path, "rb") as stream:
        try:
            metadata = _MetadataUnpickler(stream, path).load()
        except Damaged:
            raise
        except Exception as exc:  # a cut or garbled pickle
            raise Damaged(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise Damaged(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's file reader with the restricted metadata loader and checksums verified."""

    def __init__(self, path: str, fetch: Callable[[set[str]], None] | None = None) -> None:
        super().__init__(path)
        self.transforms = _VerifyingTransforms(self)
        self.fetch = fetch  # a mirror's: brings the shard files a rank's reads need

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.fetch is not None:
            self.fetch({self.storage_data[item.storage_index].relative_path for item in plan.items})
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(str(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def file_digest(path: str) -> str:
    """xxh3-64 of a small file's bytes (DCP's `.metadata`: kilobytes to a few megabytes)."""
    with open(path, "rb") as stream:
        return xxhash.xxh3_64_hexdigest(stream.read())


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but a checkpoint's byte items (the optimizer's hyperparameters:
    lr, betas, eps, ...) are read with `torch.load(weights_only=True)`; DCP's own reads them
    with `weights_only=False`, which would run whatever a crafted item holds."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            refused = re.search(r"GLOBAL ([\w.]+)", str(exc))
            what = refused.group(1) if refused else "something that is not plain data"
            raise Damaged(
                f"{read_item.storage_index.fqn}: refers to {what}, which a checkpoint never holds"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _digest(value: Any) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(value, sort_keys=True).encode())


def write_json(path: str, value: dict[str, Any]) -> None:
    """`value` as JSON with a checksum of its content, written whole and synced to disk."""
    fs.write_json(path, {**value, CHECKSUM_KEY: _digest(value)}, indent=1)


def json_bytes(value: dict[str, Any]) -> bytes:
    """`value` as `write_json` writes it (with its checksum), for an object store."""
    return json.dumps({**value, CHECKSUM_KEY: _digest(value)}, indent=1).encode()


def read_json(path: str, checked: bool = True) -> dict[str, Any]:
    """A JSON object written by `write_json`; one without a checksum is taken as it is (written
    before checksums) unless `checked` demands one."""
    with open(path, "rb") as stream:
        return parse_json(stream.read(), path, checked)


def parse_json(data: bytes, where: str, checked: bool = True) -> dict[str, Any]:
    """`read_json` of bytes already read (`where` names them in messages)."""
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise Damaged(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise Damaged(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise Damaged(f"{where}: holds a JSON {type(value).__name__}, not an object")
    if CHECKSUM_KEY in value:
        saved = value.pop(CHECKSUM_KEY)
        if saved != _digest(value):
            raise Damaged(f"{where}: fails its checksum")
    elif checked:
        raise Damaged(f"{where}: has no checksum")
    return value
