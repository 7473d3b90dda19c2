"""How a value, a key or another library's error reads inside a one-line `ConfigError`: every
message of the package is one line, whatever the user wrote."""

from __future__ import annotations

from typing import Any


def _shown(value: Any, limit: int = 80) -> str:
    """A value for a message: its repr (one line, however long or odd the value), shortened."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text if isinstance(value, str) else f"{text} ({type(value).__name__})"


def _reason(exc: Exception, limit: int = 300) -> str:
    """Another library's error as part of one line: its first line, shortened."""
    text = (str(exc).splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(key: str) -> str:
    """A key as the user wrote it, quoted when it would not read as one line of plain text."""
    return key if key.isprintable() and 0 < len(key) <= 80 else _shown(key)
