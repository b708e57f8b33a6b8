"""``--nproc-per-node N``: the launcher starts its N ranks itself and reports their outcome quietly.

torchrun itself cannot be quieted from inside a rank: when any rank exits non-zero it raises
``ChildFailedError`` and Python prints that traceback (about 30 lines) after the rank's own
``error:`` line, and torchrun exits 1 whatever the ranks' exit status was (a usage error's 2,
a signal's 128 + N). Here the same machinery (``torch.distributed.run``, as ``torchrun
--standalone``: one machine, a rendezvous on a free port) runs inside this process, which
catches that exception and leaves with the first failed rank's own exit status; torchrun's
log lines about the failure are silenced, the ranks' own lines are all that is printed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

# The loggers of torchrun's agent: each failure is also logged there, per rank, with a pointer
# to torch's docs; the ranks have already said what went wrong.
AGENT_LOGGERS = ("torch.distributed.run", "torch.distributed.launcher.api", "torch.distributed.elastic")


def _exit_status(code: int) -> int:
    """A rank's exit code as a shell reports it: a signal N (negative code) is 128 + N."""
    return 128 - code if code < 0 else code or 1


def first_failure(failures: dict) -> object:
    """The failure that came first. The agent reports the ranks it found ended at one poll (0.1 s
    apart), stamped in whole seconds: a rank that exited on its own wrote its stamp as it failed, a
    rank ended by a signal (a negative exit code: killed, crashed) wrote none and is stamped when
    the agent saw it, up to a poll later, so often one second later than its peer that exited on
    seeing it go. So among the failures stamped within one second of the earliest, one a signal
    ended comes first; then the earliest stamp; then the lowest rank."""
    earliest = min(f.timestamp for f in failures.values())
    near = [r for r, f in failures.items() if f.timestamp <= earliest + 1]
    rank = min(near, key=lambda r: (failures[r].exitcode >= 0, failures[r].timestamp, r))
    return failures[rank]


def _quiet_agent() -> None:
    """Each of the agent's modules sets its own logger's level: set every one, not only the parents."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(AGENT_LOGGERS)]
    for name in {*AGENT_LOGGERS, *names}:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_ranks(nproc: int, run_argv: list[str]) -> int:
    """Run ``python -m fsdp_fp8 run RUN_ARGV`` as ``nproc`` ranks on this machine; the exit status:
    0 when every rank succeeded, else the first failed rank's own."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    import fsdp_fp8

    _quiet_agent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, without its warning
    # The ranks import this very fsdp_fp8, wherever it lies (a checkout is not always installed).
    root = str(Path(fsdp_fp8.__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    config = torchrun.parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "fsdp_fp8", "run", *run_argv]
    )
    _quiet_agent()  # the loggers parse_args' imports made
    try:
        torchrun.run(config)
    except ChildFailedError as exc:
        return _exit_status(first_failure(exc.failures).exitcode)
    except SignalException as exc:  # this process was sent SIGINT / SIGTERM; the ranks said so
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        sys.stdout.flush()
    return 0
