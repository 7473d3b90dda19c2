"""Package faces that import on first use (PEP 562): a package hands on names from its
modules without importing them, so that importing one light module of it (a config, a
layout) does not load torch.distributed with the rest."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports each name in `homes` (name ->
    module) from its module when it is first asked for."""

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
