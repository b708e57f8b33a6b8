"""SIGINT and SIGTERM end a rank with one line and exit 128 + the signal, not a traceback per rank.

Ctrl-C sends SIGINT to every process of the terminal's job: torchrun and each rank alike; torchrun
sends SIGTERM to the ranks still running once one has failed, or when it is itself stopped. The
handler raises :class:`Interrupted` (a ``BaseException``, as ``KeyboardInterrupt`` is, so that no
``except Exception`` on the way up takes it for a failure of its own); the launcher prints one
``error:`` line on rank 0, and the other ranks leave silently with the same code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a rank other than 0 waits before it exits on an error rank 0 prints (``wait_for_rank_0``).
ERROR_GRACE_S = 3.0
# How long a signal may stay untaken by its handler inside ``ended_in_native_wait`` before the
# rank ends without it (the handler runs within moments wherever the main thread runs Python).
NATIVE_GRACE_S = 1.0

_taken = threading.Event()  # the handler ran: the main thread unwinds with ``Interrupted``


class Interrupted(BaseException):
    """The process received ``signum`` (SIGINT or SIGTERM)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum, _frame) -> None:
    _taken.set()
    # Once is enough: a second signal while the first unwinds must not interrupt the clean-up.
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def install() -> None:
    """Turn SIGINT / SIGTERM into :class:`Interrupted` in the main thread (call once, at start)."""
    _taken.clear()
    for s in SIGNALS:
        signal.signal(s, _raise)


@contextlib.contextmanager
def ended_in_native_wait() -> Iterator[None]:
    """Around a wait in native code that a peer's exit does not end: ``init_process_group``'s
    rendezvous, for a peer that already exited (a usage error only its node met). The main thread
    runs no Python handler until such a wait returns, and torchrun's SIGKILL would end the rank 30
    s after its SIGTERM, without a word. Here a thread sees the signal (``signal.set_wakeup_fd``):
    one its handler has not taken within ``NATIVE_GRACE_S`` ends the rank as the handler's path
    would, rank 0 printing ``error: stopped by SIGTERM``, with the exit status 128 + N. Only on
    the main thread with the handlers installed (elsewhere it only runs the block)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not _raise:
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    over = threading.Event()
    watcher = threading.Thread(target=_end_if_untaken, args=(read, over), name="fsdp_fp8-signal-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        over.set()
        os.close(write)  # the watcher reads the end of the pipe and returns
        watcher.join()
        os.close(read)


def _end_if_untaken(read: int, over: threading.Event) -> None:
    while signum := os.read(read, 1):
        if signum[0] not in SIGNALS:
            continue
        if _taken.wait(NATIVE_GRACE_S) or over.is_set():
            return  # the main thread runs Python again: the handler's path ends the rank
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {Interrupted(signum[0])}", file=sys.stderr, flush=True)
        os._exit(128 + signum[0])


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
