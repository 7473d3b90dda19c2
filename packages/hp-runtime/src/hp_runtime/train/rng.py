"""A rank's random states (torch CPU and CUDA, numpy, Python) as plain data: JSON with the
torch generator states as hex, numpy's as its key array and scalars, Python's as its tuple of
ints. Nothing here is unpickled, so a checkpoint's `extra/rank-*.json` cannot run code.

Checkpoints written before this held the same states in a pickle (`extra/rank-*.pt`); those
are still read, but only through torch's `weights_only` loader with numpy's few array types
admitted: anything else in the file is refused by name.
"""

from __future__ import annotations

import pickle
import random
import re
import warnings
from typing import Any

import numpy as np
import torch


def capture(device: torch.device) -> dict[str, Any]:
    """The process's random states, JSON-ready."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
        "numpy": {
            "kind": kind,
            "key": key.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes().hex()
    return states


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(text), dtype=torch.uint8).clone()


def restore(states: dict[str, Any], device: torch.device) -> None:
    """Set the process's random states from `capture`'s data (raises on a malformed one)."""
    numpy_state = states["numpy"]
    python_state = states["python"]
    torch.set_rng_state(_bytes_tensor(states["torch"]))
    np.random.set_state(
        (
            str(numpy_state["kind"]),
            np.asarray(numpy_state["key"], dtype=np.uint32),
            int(numpy_state["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
    )
    gauss = python_state["gauss_next"]
    random.setstate(
        (
            int(python_state["version"]),
            tuple(int(v) for v in python_state["state"]),
            None if gauss is None else float(gauss),
        )
    )
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(_bytes_tensor(states["cuda"]), device)


def read_legacy(path: str) -> dict[str, Any]:
    """An old `extra/rank-*.pt` as `capture`'s data, unpickled with the weights-only loader;
    numpy's state array is the one non-tensor type admitted."""
    multiarray = getattr(np, "_core", np.core).multiarray  # numpy 2 moved it
    allowed = [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on foreign pickle protocols
            saved = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = refused.group(1) if refused else "something else than random states"
        raise ValueError(f"{path}: refers to {what}, which a checkpoint never holds") from None
    kind, key, pos, has_gauss, cached = saved["numpy"]
    version, internal, gauss_next = saved["python"]
    states = {
        "torch": saved["torch"].numpy().tobytes().hex(),
        "numpy": {
            "kind": kind,
            "key": np.asarray(key).tolist(),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    if "cuda" in saved:
        states["cuda"] = saved["cuda"].numpy().tobytes().hex()
    return states
