"""Rank 0's progress bar for a long load, on stderr.

    loading [##########..............]  2.10/5.03 GB  42%  1.05 GB/s  3 s left

Bytes are what this rank has read against what it will read (its forecast,
``LoadPlan.load_bytes``), so the bar reaches 100 % exactly when the rank's reads are done.
On a terminal the line is redrawn in place (at most ``redraw_s`` apart); when stderr is not a
terminal (a log file, a CI job) a plain line is written every ``every_s`` seconds instead.
Nothing is shown for the first ``after_s`` seconds, so short loads stay silent. It writes to
stderr directly, not through ``logging``: a Python API user sees it without configuring
logging. ``FSDP_FP8_PROGRESS=0`` turns it off, ``=1`` shows it from the first byte.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24


def _size(n: float, unit: float) -> str:
    return f"{n / unit:.2f}"


def _unit(total: int) -> tuple[float, str]:
    return (1e9, "GB") if total >= 1e9 else (1e6, "MB")


class LoadProgress:
    def __init__(
        self,
        total_bytes: int,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        after_s: float = 2.0,
        every_s: float = 10.0,
        redraw_s: float = 0.1,
        clock: Callable[[], float] = time.perf_counter,
    ):
        setting = os.environ.get("FSDP_FP8_PROGRESS", "")
        self.enabled = enabled and setting != "0" and total_bytes > 0
        self.after_s = 0.0 if setting == "1" else after_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.every_s, self.redraw_s, self.clock = total_bytes, every_s, redraw_s, clock
        self.start = clock()
        self.last_shown: float | None = None
        self.done = 0

    def update(self, done_bytes: int) -> None:
        self.done = done_bytes
        if not self.enabled:
            return
        now = self.clock()
        elapsed = now - self.start
        if elapsed < self.after_s:
            return
        gap = self.redraw_s if self.tty else self.every_s
        if self.last_shown is not None and now - self.last_shown < gap and done_bytes < self.total:
            return
        self.last_shown = now
        self._show(elapsed)

    def _show(self, elapsed: float) -> None:
        unit, name = _unit(self.total)
        fraction = min(1.0, self.done / self.total)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = f"{(self.total - self.done) / rate:.0f} s left" if rate > 0 else "time left unknown"
        numbers = (
            f"{_size(self.done, unit)}/{_size(self.total, unit)} {name}  {100 * fraction:.0f}%  "
            f"{rate / 1e9:.2f} GB/s  {left}"
        )
        if self.tty:
            filled = round(BAR_WIDTH * fraction)
            self.stream.write(f"\rloading [{'#' * filled}{'.' * (BAR_WIDTH - filled)}]  {numbers}\x1b[K")
        else:
            self.stream.write(f"[fsdp_fp8] loading: {numbers}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (a terminal) with the final figures, if anything was shown."""
        if self.enabled and self.last_shown is not None:
            elapsed = self.clock() - self.start
            unit, name = _unit(self.total)
            rate = self.done / elapsed if elapsed > 0 else 0.0
            line = f"read {_size(self.done, unit)} {name} in {elapsed:.1f} s ({rate / 1e9:.2f} GB/s)"
            self.stream.write(f"\rloaded: {line}\x1b[K\n" if self.tty else f"[fsdp_fp8] loaded: {line}\n")
            self.stream.flush()
