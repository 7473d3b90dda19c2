"""A package face whose names import on first use (PEP 562), so that importing a package
(or one of its torch-free submodules) loads only what the caller uses: `hp-train --help`
and a bad config are answered before torch loads."""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import Any


class _Face(types.ModuleType):
    _homes: dict[str, str]

    def __getattr__(self, name: str) -> Any:
        if name in self._homes:
            return getattr(import_module(self._homes[name]), name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # A submodule named as a public name (`parallel.assemble`): the import system sets the
        # module there once it loads; the name stays what the face promises.
        if name in self._homes and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:  # dir() and completion list the names before first use
        return sorted({*super().__dir__(), *self._homes})


def lazy_names(module: str, homes: dict[str, str]) -> None:
    """Make package `module` hand out each name in `homes` (name -> defining module) from its
    module on first use."""
    package = sys.modules[module]
    package.__class__ = type(f"{module}.Face", (_Face,), {"_homes": homes})
