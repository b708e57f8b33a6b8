"""Leave a gloo/FSDP2 process without the SIGABRT that interpreter shutdown can cause.

gloo's worker threads free a finished async collective's tensors on their own thread, which needs
the GIL. A worker that asks for it during ``Py_FinalizeEx`` is ended inside a ``noexcept``
destructor, and libstdc++ calls ``std::terminate``, after every result was correct. No
Python-level cleanup closes that race for certain; not finalizing does (:func:`shutdown_distributed`).

On the failure path the group is aborted, not destroyed: NCCL's destroy waits for collectives a
dead peer never joins, while an abort returns at once.

Evidence and signals: docs/shutdown.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

import torch
import torch.distributed as dist

from fsdp_fp8.errors import ArgumentError

logger = logging.getLogger(__name__)


def abort_process_group() -> None:
    """Tear down every process group without waiting for peers (``ncclCommAbort`` on NCCL).

    ``_abort_process_group`` is torch's own (private, in 2.10 through 2.13; gloo accepts it
    too). Where a torch lacks it the group is left alone: the process exits next and its
    communicators end with it, which is still better than a destroy that waits forever.
    """
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        logger.warning("torch %s has no _abort_process_group; leaving the process group to the exit", torch.__version__)
        return
    abort()


def shutdown_distributed(exit_code: int | None = None, *, failed: bool | None = None) -> None:
    """Destroy the default process group; with ``exit_code``, also end the process cleanly.

    ``failed`` (default: ``exit_code`` is neither None nor 0): abort the group instead of
    destroying it, so no rank waits on a collective a failed peer never joins (see above).

    ``exit_code=None``: destroy the process group (if any) and return. The interpreter's own
    exit may still abort as described above; use this form only where the process goes on
    living (a notebook, a test that keeps running).

    ``exit_code=<int>``: destroy the process group, then do what a normal exit does that
    matters - run ``atexit`` handlers (this includes ``logging.shutdown()``, which flushes
    and closes every handler), flush ``sys.stdout``/``sys.stderr`` - and leave with
    ``os._exit(exit_code)``, skipping only interpreter finalization, where the race lives.
    Never returns. Files the program left open without ``with`` are not flushed: close them
    first. Non-daemon threads are not waited for; a warning names them.

    Call it last, on every rank, with the code the process should exit with::

        try:
            code = main()
        except BaseException:
            shutdown_distributed(failed=True)   # keep the traceback and Python's exit status
            raise
        shutdown_distributed(code)
    """
    if exit_code is not None and (type(exit_code) is not int or not 0 <= exit_code <= 255):
        raise ArgumentError(f"exit_code must be an int in [0, 255] or None, got {exit_code!r}", "shutdown_distributed")
    if failed is None:
        failed = exit_code not in (None, 0)
    if dist.is_available() and dist.is_initialized():
        if failed:
            abort_process_group()
        else:
            dist.destroy_process_group()
    if exit_code is None:
        return
    import threading

    others = [t.name for t in threading.enumerate()
              if t is not threading.main_thread() and not t.daemon and t.is_alive()]  # fmt: skip
    if others:
        logger.warning("exiting with non-daemon threads still running: %s", ", ".join(others))
    # atexit handlers run before finalization in a normal exit too; logging's flushes and
    # closes the log handlers.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to save
            pass
    os._exit(exit_code)
