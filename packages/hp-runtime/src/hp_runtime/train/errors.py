"""The errors hp-train reports to its user, each in one line: what the user can change
(`ConfigError`), a run that cannot go on (`TrainError`), and a rank that stops because another
failed (`PeerFailed`). Torch-free, so that every module (and a command that only reads files)
can raise and catch them without loading torch.distributed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration a run cannot start from; the message is one line for the user."""


class TrainError(RuntimeError):
    """A run that cannot go on; the message is one line for the user."""

    fallback = False  # whether resuming may try an older checkpoint instead
    everywhere = False  # raised alike on every rank (then rank 0 alone reports it)


class PeerFailed(TrainError):
    """Another rank failed; it reports the reason, this one stops quietly."""
