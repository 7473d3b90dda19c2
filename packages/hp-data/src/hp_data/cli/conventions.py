"""What every `hp-data` command shares: hp-data's errors as one line and an exit code,
printing (`--json` too), and the options that several commands take."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import click

from hp_data.errors import ArgumentError, HpDataError
from hp_data.redact import redact, redact_data
from hp_data.remote import DEFAULT_TIMEOUT

# The version of every command's --json output; the keys are listed in docs/cli.md.
SCHEMA = 1

_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class _Command(click.Command):
    """The library's `ArgumentError` (arguments that contradict each other) is a usage error,
    as click's own are: exit 2, after this command's usage line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ArgumentError as exc:
            raise click.UsageError(str(exc), ctx) from None


class _Group(click.Group):
    """Turns hp-data's own errors and OS errors into one line on stderr and exit code 1
    (with --json, also the failure's JSON on stdout), and a closed stdout into a quiet exit."""

    command_class = _Command

    def invoke(self, ctx: click.Context) -> Any:
        formatter, warnings.formatwarning = warnings.formatwarning, _one_line_warning
        try:
            with warnings.catch_warnings():
                return super().invoke(ctx)
        except BrokenPipeError:
            # `hp-data inspect --show 100 | head`: the reader has what it wanted. Point
            # stdout at /dev/null so that the exit's flush cannot fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except HpDataError as exc:
            raise _failure(ctx, str(exc)) from None
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            raise _failure(ctx, f"{where}{exc.strerror or exc}") from None
        finally:
            warnings.formatwarning = formatter


def _failure(ctx: click.Context, message: str) -> click.ClickException:
    message = redact(message)  # an OSError's, or a third party's, may quote a URL
    if ctx.meta.get("hp_json"):
        _emit({}, [message])
    return click.ClickException(message)


def _echo(message: str, err: bool = False) -> None:
    """Print a line of hp's: every one but a corpus's own text goes through here, so that
    none shows a credential (`redact`)."""
    click.echo(redact(message), err=err)


def _emit(
    payload: dict[str, Any], problems: Iterable[str] = (), verbatim: Iterable[str] = ()
) -> None:
    """A command's --json output: one object, the same shape on success and failure, with
    every string redacted but those of the `verbatim` keys (a corpus's own text)."""
    problems = list(problems)
    body = {"schema": SCHEMA, "ok": not problems, "problems": problems, **payload}
    kept = {key: body.pop(key) for key in verbatim if key in body}
    click.echo(json.dumps({**redact_data(body), **kept}))


def _json_option(what: str) -> _Decorator:
    """--json, remembered for the error handler (which then prints the failure as JSON)."""

    def remember(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        ctx.meta["hp_json"] = value
        return value

    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        callback=remember,
        is_eager=True,
        help=f"Print {what} as one JSON object (keys: docs/cli.md).",
    )


def _quiet_option(what: str = "progress bars") -> _Decorator:
    """--quiet: no {what} or notes on stderr. Warnings still print (one line each): they are
    about the result."""

    return click.option("--quiet", is_flag=True, help=f"No {what} or notes; warnings still show.")


def _unit_bytes(units: int | None, unit_mb: float | None) -> int | None:
    if units is not None and unit_mb is not None:
        raise click.UsageError("give --units or --unit-mb, not both")
    return None if unit_mb is None else max(int(unit_mb * (1 << 20)), 1)


def _finite(param: click.Parameter, value: float) -> float:
    """click's FloatRange lets NaN through (every comparison with it is false)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number", param=param)
    return value


def _one_line_warning(message: Warning | str, *args: object, **kwargs: object) -> str:
    """A warning as users of a command read it: no file, line or source of hp's code."""
    return f"Warning: {redact(str(message))}\n"


# The work-unit options, the same for plan and preprocess (which must agree on the plan).
_units_option = click.option(
    "--units",
    type=click.IntRange(min=1),
    default=None,
    help="Cut the inputs into about this many work units (see hp-data plan).",
)

_unit_mb_option = click.option(
    "--unit-mb",
    type=click.FloatRange(min=0.001, max=1 << 30),
    callback=lambda ctx, param, value: None if value is None else _finite(param, value),
    default=None,
    help="Work-unit size in MB [default: 256, or a quarter of a shard].",
)

_remote_timeout_option = click.option(
    "--remote-timeout",
    type=click.FloatRange(min=0, min_open=True),
    callback=lambda ctx, param, value: _finite(param, value),
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds a remote (http(s), s3) request may wait to connect or for its next bytes; "
    "a failed request is tried 3 times, then the run stops naming the object.",
)


def _num_shards_option(text: str) -> Any:
    return click.option(
        "--num-shards",
        type=click.IntRange(min=1, max=99_999),
        default=1,
        show_default=True,
        help=text,
    )
