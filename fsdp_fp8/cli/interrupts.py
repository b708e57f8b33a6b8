"""SIGINT and SIGTERM end a rank with one line and exit 128 + the signal, not a traceback per rank.

Ctrl-C sends SIGINT to every process of the terminal's job: torchrun and each rank alike; torchrun
sends SIGTERM to the ranks still running once one has failed, or when it is itself stopped. The
handler raises :class:`Interrupted` (a ``BaseException``, as ``KeyboardInterrupt`` is, so that no
``except Exception`` on the way up takes it for a failure of its own); the launcher prints one
``error:`` line on rank 0, and the other ranks leave silently with the same code.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
