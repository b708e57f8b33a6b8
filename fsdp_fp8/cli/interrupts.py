"""SIGINT and SIGTERM end a rank with one line and exit 128 + the signal, not a traceback per rank.

Ctrl-C sends SIGINT to every process of the terminal's job: torchrun and each rank alike; torchrun
sends SIGTERM to the ranks still running once one has failed, or when it is itself stopped. The
handler raises :class:`Interrupted` (a ``BaseException``, as ``KeyboardInterrupt`` is, so that no
``except Exception`` on the way up takes it for a failure of its own); the launcher prints one
``error:`` line on rank 0, and the other ranks leave silently with the same code.
"""

from __future__ import annotations

import os
import signal
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a rank other than 0 waits before it exits on an error rank 0 prints (``wait_for_rank_0``).
ERROR_GRACE_S = 3.0


class Interrupted(BaseException):
    """The process received ``signum`` (SIGINT or SIGTERM)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum, _frame) -> None:
    # Once is enough: a second signal while the first unwinds must not interrupt the clean-up.
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def install() -> None:
    """Turn SIGINT / SIGTERM into :class:`Interrupted` in the main thread (call once, at start)."""
    for s in SIGNALS:
        signal.signal(s, _raise)


def ignore() -> None:
    """Once a rank's outcome is printed and its exit code decided: torchrun's SIGTERM (sent to
    every rank once one has failed) must not interrupt the exit's clean-up (``atexit``
    handlers, the process group's abort) with a second message and a traceback."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def wait_for_rank_0() -> bool:
    """What a rank other than 0 does before it exits on an error that rank 0 prints (a usage error,
    an agreed load failure): torchrun stops every rank once one exits, so a rank that exits first
    could have rank 0 killed before it printed. Under torchrun (``TORCHELASTIC_RUN_ID``; the
    launcher's own ``--nproc-per-node`` goes through torchrun too) wait ``ERROR_GRACE_S``: rank 0
    prints and exits at once, and torchrun then ends the waiting ranks. Outside torchrun nothing
    waits. A signal meanwhile (torchrun's SIGTERM, once handlers are installed) ends it quietly.

    True when this rank waited the whole grace and is still running: rank 0 has not ended the
    job, so it may not have met the error at all (a file only this rank's node lacks)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        time.sleep(ERROR_GRACE_S)
    except Interrupted:
        return False
    return True
