"""The progress line reports done/total, rates and an ETA."""

from __future__ import annotations

import io

from hp_data.progress import Progress, clock, human


def test_log_lines_show_fraction_rates_and_eta():
    stream = io.StringIO()
    progress = Progress(1000, "job", stream=stream, log_every=0.0)
    progress.update(250, docs=10, tokens=5000)
    line = stream.getvalue().splitlines()[-1]
    assert line.startswith("job [######")
    assert " 25.0% " in line
    assert "docs/s" in line and "tokens/s" in line
    assert "ETA " in line


def test_disabled_progress_prints_nothing():
    stream = io.StringIO()
    progress = Progress(10, "job", enabled=False, stream=stream, log_every=0.0)
    progress.update(5, docs=1)
    progress.close()
    assert stream.getvalue() == ""


def test_human_and_clock():
    assert human(999) == "999"
    assert human(1234567, "B") == "1.23MB"
    assert clock(59) == "0:59"
    assert clock(3725) == "1:02:05"
