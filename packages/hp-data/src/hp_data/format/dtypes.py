"""Token dtypes of the Megatron IndexedDataset format and their one-byte codes."""

from __future__ import annotations

import numpy as np

from hp_data.errors import IndexedDatasetError

# Megatron-LM's DType enum: the code written into the `.idx` header.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_CODES.items()}

DTypeLike = np.dtype | type | str


def as_token_dtype(dtype: DTypeLike) -> np.dtype:
    """Normalise `dtype` and check the format can store it (native little-endian, one of 8)."""
    try:
        normalised = np.dtype(dtype).newbyteorder("=")
    except TypeError as exc:
        raise IndexedDatasetError(f"not a numpy dtype: {dtype!r}") from exc
    if normalised not in _CODE_OF:
        names = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise IndexedDatasetError(f"dtype {normalised} cannot be stored; use one of: {names}")
    return normalised


def code_from_dtype(dtype: DTypeLike) -> int:
    """The header code for `dtype`."""
    return _CODE_OF[as_token_dtype(dtype)]


def dtype_from_code(code: int) -> np.dtype:
    """The dtype for a header code; unknown codes raise IndexedDatasetError."""
    try:
        return DTYPE_CODES[code]
    except KeyError:
        raise IndexedDatasetError(
            f"unknown dtype code {code} (known: {sorted(DTYPE_CODES)})"
        ) from None


def optimal_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits, else int32.

    Megatron switches at 65500; ids 0..65535 all fit in uint16, so hp switches at 65536.
    """
    if vocab_size < 0:
        raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def check_token_range(tokens: np.ndarray, dtype: np.dtype) -> None:
    """Reject tokens that `dtype` cannot represent exactly, instead of wrapping them silently."""
    if tokens.size == 0 or tokens.dtype == dtype:
        return
    if dtype.kind == "f":
        if tokens.dtype.kind not in "biuf":
            raise IndexedDatasetError(f"tokens of dtype {tokens.dtype} cannot be stored as {dtype}")
        return
    if tokens.dtype.kind not in "biu":
        raise IndexedDatasetError(
            f"tokens must be integers to be stored as {dtype}, got dtype {tokens.dtype}"
        )
    info = np.iinfo(dtype)
    low, high = int(tokens.min()), int(tokens.max())
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise IndexedDatasetError(
            f"token id {bad} does not fit {dtype} (range {info.min}..{info.max}); "
            f"build with a wider dtype such as int32"
        )
