"""The error classes hp-data raises for bad input.

Every user-facing failure (a corrupt file, a malformed corpus line, a bad argument) is one of
these, so callers and the CLI can report it in one line instead of a traceback.
"""


class HpDataError(Exception):
    """Base class for every error hp-data raises on bad input."""


class IndexedDatasetError(HpDataError):
    """A `.bin`/`.idx` pair is missing, corrupt, or used inconsistently."""


class PreprocessError(HpDataError):
    """A corpus or tokenizer cannot be turned into a dataset (message starts with file:line)."""
