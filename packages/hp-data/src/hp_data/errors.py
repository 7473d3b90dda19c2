"""The error classes hp-data raises for bad input.

Every user-facing failure (a corrupt file, a malformed corpus line, a bad argument) is one of
these, so callers and the CLI can report it in one line instead of a traceback.
"""

import os
import stat
from typing import BinaryIO

from hp_data.redact import redact


class HpDataError(Exception):
    """Base class for every error hp-data raises on bad input. Its message never holds a
    credential (`redact`): it names inputs by URL, and it is printed, logged and pasted."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))


class IndexedDatasetError(HpDataError):
    """A `.bin`/`.idx` pair is missing, corrupt, or used inconsistently."""


class ArgumentError(HpDataError):
    """Arguments that contradict each other or would size nothing; `hp-data` reports it as a
    usage error (exit 2, after the command's usage line), as it does its own parsing errors."""


class PreprocessError(HpDataError):
    """A corpus or tokenizer cannot be turned into a dataset (message starts with file:line)."""


def open_input(path: str, error: type[HpDataError], expected: str) -> BinaryIO:
    """Open regular file `path` for binary reading, or raise `error` saying in one line why
    not. Opened without blocking: a FIFO at the path would otherwise wait for a writer."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected {expected}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror}") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise error(f"{path}: is {kind}, expected {expected}")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")
