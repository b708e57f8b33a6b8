"""How much slower than a quiet reference machine this one runs right now, measured.

Hang guards (``run_ranks``' timeouts, pytest-timeout, subprocess timeouts) and the few bounds a
test asserts on seconds were sized on a quiet 2-core machine. On a busy one every step takes
longer, by about the same factor, so each such bound is multiplied by ``slowdown()``::

    from calibration import bound
    assert record["seconds"] < bound(10.0)   # 10 s on the reference machine

``slowdown()`` runs a fixed pure-Python workload (a few tens of milliseconds) and combines

- the machine's speed: the workload's CPU seconds against ``REFERENCE_CPU_S``, what it takes on
  the reference machine (a slower CPU gets a factor above 1, a faster one is not shrunk below);
- the share of a core this process gets now: wall seconds over CPU seconds of the same run;
- the queue: the 1-minute load average over the usable cores.

The factor is the speed times the larger of the last two, at least 1 and at most ``MAX_SLOWDOWN``;
a measurement is reused for ``REMEASURE_S`` and the largest factor of the last ``WINDOW_S`` is
returned, so a bound derived after a busy spell stays as loose as the spell required.
``FSDP_FP8_TEST_SLOWDOWN=<factor>`` sets a floor (a machine known to be slow, or a debugger).
Nothing here makes a test assert less: only seconds scale, never an order or a result.
"""

from __future__ import annotations

import os
import threading
import time

REFERENCE_CPU_S = 0.016  # _workload's CPU seconds on the reference machine (2 cores, quiet)
MAX_SLOWDOWN = 16.0  # a guard must still fire some day on a machine that is only misreported
REMEASURE_S = 15.0
WINDOW_S = 300.0
ENV = "FSDP_FP8_TEST_SLOWDOWN"

_lock = threading.Lock()
_history: list[tuple[float, float]] = []  # (monotonic time, factor), oldest first


def _workload() -> int:
    total = 0
    for i in range(300_000):
        total += i * i % 7
    return total


def measure() -> float:
    """One fresh measurement of the slowdown factor (not clamped by the window)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(3):
        _workload()
    wall, cpu = time.perf_counter() - wall0, max(time.process_time() - cpu0, 1e-6)
    speed = max(1.0, cpu / (3 * REFERENCE_CPU_S))
    share = wall / cpu
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    queue = os.getloadavg()[0] / cores if hasattr(os, "getloadavg") else 1.0
    return min(MAX_SLOWDOWN, max(1.0, speed * max(1.0, share, queue)))


def floor() -> float:
    text = os.environ.get(ENV, "")
    try:
        return max(1.0, float(text)) if text else 1.0
    except ValueError:
        raise ValueError(f"{ENV} must be a number (a slowdown factor), got {text!r}") from None


def slowdown() -> float:
    """The factor to multiply a reference-machine bound in seconds by, right now."""
    now = time.monotonic()
    with _lock:
        while _history and _history[0][0] < now - WINDOW_S:
            _history.pop(0)
        if not _history or _history[-1][0] < now - REMEASURE_S:
            _history.append((now, measure()))
        return max(floor(), max(factor for _, factor in _history))


def bound(seconds: float) -> float:
    """``seconds`` on the reference machine, as a bound for this machine now."""
    return seconds * slowdown()
