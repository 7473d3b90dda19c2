"""A hang watchdog: a step far slower than the others dumps every rank's stacks and stops the
job with one line naming the stuck ranks.

One stuck rank (a stalled filesystem read, a dead data worker, a GPU that stopped) leaves every
other rank waiting inside a collective until the collective timeout, with nothing said of
which rank or where. Each rank runs this thread beside its loop. The loop beats at each phase
of a step (`PHASES`); when a step has taken longer than the limit (`train.hang_timeout_s`, or
by default 10 x the median step and at least 5 minutes), the rank writes its Python stacks
(every thread, by `faulthandler`) and where it is to `RUN_DIR/hang/rank-R.{txt,json}` (and on
NCCL the flight recorder's last collectives, `rank-R.nccl`), and leaves with exit status 1.
Rank 0 first waits a little for the others' files and names the ranks that are furthest
behind — the stuck ones; the others wait for them inside a collective — in
`RUN_DIR/hang/summary.json` and in one line on stderr.

Only the training steps are watched, from the second (the first compiles and warms up):
logging, validation and checkpoints run between beats, under the collective timeout only.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from hp_data.fs import write_json

PHASES = ("data", "forward-backward", "update")  # a step's phases, in the order they run
MIN_AUTO_LIMIT = 300.0  # seconds: the default limit is never shorter
AUTO_FACTOR = 10  # x the median step
GATHER_S = 20.0  # how long rank 0 waits for the other ranks' reports


class Watchdog:
    """Beats from the loop, a thread that fires when one is overdue (`start` to run it)."""

    def __init__(
        self,
        run_dir: str,
        rank: int,
        world: int,
        limit_s: float = 0.0,
        poll_s: float = 1.0,
        say: Callable[[str], None] | None = None,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.directory = os.path.join(run_dir, "hang")
        self.rank, self.world, self.fixed, self.poll = rank, world, limit_s, poll_s
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.exit = exit
        self.times: deque[float] = deque(maxlen=50)
        self._beat: tuple[int, int, float] | None = None  # (step, phase, since): one assignment
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, step: int, phase: str) -> None:
        """The loop is at `phase` of `step` (a step starts at its first phase)."""
        since = time.monotonic() if phase == PHASES[0] or self._beat is None else self._beat[2]
        self._beat = (step, PHASES.index(phase), since)

    def step_done(self, seconds: float) -> None:
        """A step finished in `seconds`: not watched until the next one starts."""
        self.times.append(seconds)
        self._beat = None

    def limit(self) -> float:
        if self.fixed > 0:
            return self.fixed
        median = statistics.median(self.times) if self.times else 0.0
        return max(MIN_AUTO_LIMIT, AUTO_FACTOR * median)

    def overdue(self, now: float) -> tuple[int, int, float] | None:
        """The beat a step has been stuck at for longer than the limit, if any."""
        beat = self._beat
        if beat is None or not self.times:  # between steps, or the first step
            return None
        return beat if now - beat[2] > self.limit() else None

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            beat = self.overdue(time.monotonic())
            if beat is not None:
                self.fire(*beat)
                return

    def fire(self, step: int, phase: int, since: float) -> None:
        """Report this rank, name the stuck ranks (rank 0) and leave the job."""
        os.makedirs(self.directory, exist_ok=True)
        waited = time.monotonic() - since
        with open(os.path.join(self.directory, f"rank-{self.rank}.txt"), "w") as stacks:
            faulthandler.dump_traceback(stacks, all_threads=True)
        _nccl_trace(os.path.join(self.directory, f"rank-{self.rank}.nccl"))
        report = {"rank": self.rank, "step": step, "phase": PHASES[phase], "waited_s": waited}
        _write_json(os.path.join(self.directory, f"rank-{self.rank}.json"), report)
        if self.rank == 0:
            self.say(f"hp-train: error: {self.summary(step, waited)}")
        else:  # give rank 0 the time to read this rank's report before the launcher stops all
            deadline = time.monotonic() + GATHER_S + 5
            while time.monotonic() < deadline and not os.path.exists(self._summary_path()):
                time.sleep(0.2)
        self.exit(1)

    def _summary_path(self) -> str:
        return os.path.join(self.directory, "summary.json")

    def summary(self, step: int, waited: float) -> str:
        """The job's line: which ranks are furthest behind (from every report that came)."""
        reports = self._gather()
        silent = sorted(set(range(self.world)) - {r["rank"] for r in reports})
        if silent:  # stuck outside a step (a log, a validation, a save), or gone
            stuck, where = silent, "no step (stuck between steps, or gone: no report)"
        else:
            last = min((r["step"], PHASES.index(r["phase"])) for r in reports)
            stuck = [r["rank"] for r in reports if (r["step"], PHASES.index(r["phase"])) == last]
            where = f"step {last[0]}'s {PHASES[last[1]]}"
        stuck = sorted(stuck)
        _write_json(self._summary_path(), {"stuck": stuck, "silent": silent, "reports": reports})
        names = f"rank {stuck[0]}" if len(stuck) == 1 else f"ranks {_ranks(stuck)}"
        return (
            f"step {step} hangs ({waited:.0f} s, limit {self.limit():.0f} s, "
            f"train.hang_timeout_s): {names} stuck at {where}; the stacks of every rank "
            f"that reported are in {self.directory}"
        )

    def _gather(self) -> list[dict]:
        """Every rank's report, waiting a bounded time for them (each fires on its own clock)."""
        deadline = time.monotonic() + min(GATHER_S, self.limit())
        while True:
            paths = (os.path.join(self.directory, f"rank-{r}.json") for r in range(self.world))
            reports = [r for r in map(_read_json, paths) if r is not None]
            if len(reports) == self.world or time.monotonic() > deadline:
                return reports
            time.sleep(0.2)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _read_json(path: str) -> dict | None:
    with contextlib.suppress(OSError, ValueError), open(path) as handle:
        return json.load(handle)
    return None


def _write_json(path: str, value: object) -> None:
    """Written whole, then renamed: a reader never sees half a report. Not synced: a report
    of the moment, rewritten while the run lives, and a stuck filesystem must not stop it."""
    write_json(path, value, durable=False)


def _nccl_trace(path: str) -> None:
    """NCCL's flight recorder (the collectives in flight and the last ones done), where the
    process group is NCCL's and torch records them (`TORCH_NCCL_TRACE_BUFFER_SIZE`)."""
    with contextlib.suppress(Exception):  # not NCCL, or no recorder: the stacks say enough
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_backend() == "nccl":
            from torch._C._distributed_c10d import _dump_nccl_trace

            with open(path, "wb") as handle:
                handle.write(_dump_nccl_trace())
