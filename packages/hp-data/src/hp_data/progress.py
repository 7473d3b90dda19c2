"""A dependency-free progress line on stderr: done/total, rates and an ETA.

On a terminal the line redraws in place a few times a second; elsewhere (CI logs, pipes) it
prints a plain line every `log_every` seconds so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from hp_data.redact import redact


def human(number: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (decimal prefixes, as throughput is usually quoted)."""
    for prefix in ("", "k", "M", "G", "T"):
        if abs(number) < 1000 or prefix == "T":
            text = f"{number:.0f}" if prefix == "" else f"{number:.3g}"
            return f"{text}{prefix}{unit}"
        number /= 1000
    raise AssertionError("unreachable")


def clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Track `done` out of `total` units (bytes, say) plus named counters shown as rates."""

    def __init__(
        self,
        total: int,
        label: str,
        enabled: bool = True,
        stream: TextIO | None = None,
        log_every: float = 10.0,
        already: int = 0,
    ) -> None:
        self.known = total > 0  # 0: unknown (a stream), shown without a bar or an ETA
        self.total = max(total, 1)
        self.already = already  # done before this run (resumed work): not part of the rates
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.interval = 0.2 if self.tty else log_every
        self.start = time.perf_counter()
        self._last = self.start
        self.done = 0
        self.counters: dict[str, int] = {}

    def update(self, done: int, **counters: int) -> None:
        """Set progress to `done` units and the counters to their running totals."""
        self.done = done
        self.counters.update(counters)
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._draw(now)

    def add_bytes(self, count: int) -> None:
        """Count `count` more units done, shown as a bytes/s rate: a copy's progress."""
        self.update(self.done + count, bytes=self.done + count)

    def _draw(self, now: float, final: bool = False) -> None:
        elapsed = max(now - self.start, 1e-9)
        fraction = min(self.done / self.total, 1.0)
        width = 24
        bar = "#" * int(fraction * width) + "." * (width - int(fraction * width))
        rates = "  ".join(
            f"{human(v / elapsed, 'B')}/s" if k == "bytes" else f"{human(v / elapsed)} {k}/s"
            for k, v in self.counters.items()
        )
        speed = (self.done - self.already) / elapsed
        if final:
            tail = f"{clock(elapsed)} total"
        elif speed > 0 and self.known:
            tail = f"ETA {clock(max(self.total - self.done, 0) / speed)}"
        else:
            tail = "ETA ?"
        if self.known:
            line = f"{self.label} [{bar}] {fraction:6.1%}  {rates}  {tail}"
        else:
            line = f"{self.label} {human(self.done, 'B')} read  {rates}  {tail}"
        line = redact(line)  # a label may name an input
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state: totals and the wall time."""
        if self.enabled:
            self._draw(time.perf_counter(), final=True)
