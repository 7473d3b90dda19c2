"""The file system's part of the config check: what the run reads exists and what it writes
can be written. Apart from `build_config`, since a stored config names the paths of its day."""

from __future__ import annotations

import glob
import os

from hp_data.errors import HpDataError
from hp_data.fs import creatable_dir_problem
from hp_data.registry import dataset_type

from hp_runtime.train.config.messages import _reason, _shown
from hp_runtime.train.config.schema import Config
from hp_runtime.train.errors import ConfigError


def _kind(path: str) -> str | None:
    """ "dir", "file" (anything else that exists) or None when `path` names nothing."""
    try:
        return "dir" if os.path.isdir(path) else "file" if os.path.lexists(path) else None
    except (ValueError, OSError):  # an embedded NUL, a name too long
        return None


def _plain(key: str, path: str) -> None:
    """`path` can name a file at all: no NUL, encodable for the file system."""
    try:
        if "\0" not in path:
            os.fsencode(path)
            return
    except UnicodeError:
        pass
    raise ConfigError(f"{key}: {_shown(path)} cannot be a path on this system")


def _need(key: str, path: str, kind: str | None = None) -> None:
    """`path` (the value of `key`) exists, as a directory or a file when `kind` says so."""
    _plain(key, path)
    found = _kind(path)
    if found is None:
        raise ConfigError(f"{key}: {_shown(path)}: no such file or directory")
    if kind is not None and found != kind:
        wanted = "a directory" if kind == "dir" else "a file"
        raise ConfigError(f"{key}: {_shown(path)} is not {wanted}")


def _writable_dir(key: str, path: str) -> None:
    """`path` is a directory this process can write in, or one it can create there."""
    if not path:
        raise ConfigError(f"{key}: empty; give a directory")
    _plain(key, path)
    problem = creatable_dir_problem(path, _shown)
    if problem is not None:
        raise ConfigError(f"{key}: {_shown(path)}: {problem}")


def _need_corpus(key: str, config: Config, spec: str) -> None:
    """A megatron prefix or blend, or a json_file / hf_datasets input, that exists."""
    from hp_data.format.commit import journal_path
    from hp_data.format.header import prefix_of
    from hp_data.remote import is_url

    kind = config.data.type
    _plain(key, spec)
    if kind == "json_file":
        if not is_url(spec) and not (glob.has_magic(spec) and glob.glob(spec)):
            _need(key, spec)
        return
    if kind == "hf_datasets":
        if not is_url(spec):
            _need(key, spec, "dir")
        return
    from hp_data.blend import parse_blend

    try:
        prefixes, _ = parse_blend(spec)
    except HpDataError as exc:
        raise ConfigError(f"{key}: {_reason(exc)}") from None
    for prefix in map(prefix_of, prefixes):
        if is_url(prefix):
            continue  # asked of the store when the data is read (train/data.py `_prefixes`)
        if _kind(journal_path(prefix)) is not None:
            continue  # an interrupted write, which opening the dataset finishes
        for suffix in (".idx", ".bin"):
            if _kind(prefix + suffix) != "file":
                raise ConfigError(
                    f"{key}: {_shown(prefix + suffix)}: no such file (a prefix names "
                    "PREFIX.bin and PREFIX.idx)"
                )


def check_paths(config: Config) -> None:
    """What the run reads exists and what it writes can be written: the file system's part of
    the config check, apart from `build_config` (a stored config names paths of its day)."""
    _writable_dir("train.run_dir", config.train.run_dir)
    data = config.data
    if data.cache_dir is not None:
        _writable_dir("data.cache_dir", data.cache_dir)
    if dataset_type(data.type).needs_path:
        for key in ("data.path", "data.valid_path"):
            spec = getattr(data, key.split(".")[1])
            if spec is not None:
                _need_corpus(key, config, spec)
        for i, phase in enumerate(data.phases):
            _need_corpus(f"data.phases[{i}].path", config, phase.path)
    if dataset_type(data.type).needs_tokenizer and data.tokenizer is not None:
        from hp_data.tokenize import TokenizerFiles

        try:
            TokenizerFiles.locate(data.tokenizer)
        except HpDataError as exc:
            raise ConfigError(f"data.tokenizer: {_reason(exc)}") from None
    if config.model_init_from is not None:
        _need("model.init_from", config.model_init_from, "dir")
    _checkpoint_dir(config)
    check_eval_paths(config.eval.tasks, config.eval.include, config.eval.tokenizer)
    if config.checkpoint.resume not in ("auto", "none"):
        # Only its form: a path seeds an empty run directory and is ignored once the run has
        # checkpoints of its own (a deleted scratch seed must not stop a preempted run); the
        # checkpointer refuses a missing one when it would be used.
        _plain("checkpoint.resume", config.checkpoint.resume)


def is_task_file(name: str) -> bool:
    """An `eval.tasks` entry that names a task YAML file rather than a registered task."""
    return name.endswith(".yaml")


def check_eval_paths(
    tasks: tuple[str, ...], include: tuple[str, ...], tokenizer: str | None, prefix: str = "eval."
) -> None:
    """`[eval]`'s task files and include directories exist, and its tokenizer is found."""
    for name in tasks:
        if is_task_file(name):
            _need(f"{prefix}tasks", name, "file")
        elif name.endswith(".yml"):  # lm-eval's index reads *.yaml only
            raise ConfigError(
                f"{prefix}tasks: {_shown(name)}: lm-eval reads task files named *.yaml; rename it"
            )
    for directory in include:
        _need(f"{prefix}include", directory, "dir")
    if tokenizer is not None:
        from hp_data.tokenize import TokenizerFiles

        try:
            TokenizerFiles.locate(tokenizer)
        except HpDataError as exc:
            raise ConfigError(f"{prefix}tokenizer: {_reason(exc)}") from None


def _checkpoint_dir(config: Config) -> None:
    """`checkpoint.dir`: a directory this process can write in, or a URL prefix of a store
    whose library is installed (nothing is asked of the store yet)."""
    from hp_data.redact import redact
    from hp_data.remote import is_remote, local_path, store_path

    if is_remote(config.checkpoint.resume):
        _credential_free("checkpoint.resume", config.checkpoint.resume)
    where = config.checkpoint.dir
    if where is None or not is_remote(where):
        if config.checkpoint.local_copy:
            raise ConfigError(
                "checkpoint.local_copy: only with a URL checkpoint.dir (a local one is on a "
                "disk already); remove it"
            )
        if where is not None:
            _writable_dir("checkpoint.dir", local_path(where))
        return
    _plain("checkpoint.dir", where)
    _credential_free("checkpoint.dir", where)
    shown = _shown(redact(where))
    try:
        _, path = store_path(where)
    except HpDataError as exc:
        reason = str(exc).replace("hp-data[remote]", "hp-runtime[remote]")
        raise ConfigError(f"checkpoint.dir: {redact(reason)}") from None
    if not path.strip("/"):
        raise ConfigError(f"checkpoint.dir: {shown} names no bucket or prefix")


def _credential_free(key: str, url: str) -> None:
    """A checkpoint URL without a user, password, query or fragment: object stores take no
    credentials in a prefix (a presigned URL signs one object), and what names a checkpoint
    is printed and stored (redacted, but a library's own error may quote it as it is)."""
    from hp_data.redact import redact

    authority = url.split("://", 1)[1].split("/", 1)[0]
    if "@" in authority or "?" in url or "#" in url:
        raise ConfigError(
            f"{key}: {_shown(redact(url))}: a checkpoint URL carries no credentials, query or "
            "fragment; give the store's credentials in its environment or fsspec configuration"
        )
