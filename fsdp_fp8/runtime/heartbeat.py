"""Stalled peers named: a heartbeat over the job's store while the ranks generate.

Inside :func:`watch_peers` every rank writes a beat to the default group's store (torchrun's,
outside every rank) each ``interval_s``, and reads the others'. A peer silent for ``stall_s`` is
named by rank, host and pid, within ``stall_s + 2 * interval_s``; ``stall_s_for`` takes half the
launcher's ``--timeout`` when that is shorter than 30 s.

A rank blocked in a collective cannot raise, so the watcher prints the line and calls
``os._exit(1)``. When the collective raises first, the block raises ``PeerLostError`` naming the
gone peer; an agreed ``ProblemsError`` passes unchanged. A rank that leaves the block says so.

Reliability: docs/reliability.md, "A stalled peer during generation is named".
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import sys
import threading
import time
from typing import Iterator

import torch.distributed as dist

from fsdp_fp8.errors import ArgumentError, PeerLostError, ProblemsError

DEFAULT_STALL_S = 30.0  # no beat for this long: the peer is named
DEFAULT_INTERVAL_S = 1.0  # how often each rank beats and looks at the others
# After a signal, how many intervals a gone peer has to show its last word before it is named.
SIGNAL_WORD_BEATS = 3
# A gone peer: how many intervals the main thread has to name it before the watcher does.
GONE_GRACE_BEATS = 2
EXIT_CODE = 1
_PREFIX = "fsdp_fp8/heartbeat"
_watches = itertools.count()  # every rank enters its watches in the same order


def stall_s_for(pg_timeout_s: float) -> float:
    """The launcher's stall threshold: the default, or half the process-group timeout when
    that is shorter, so that a stalled peer is named before the transport times out."""
    return min(DEFAULT_STALL_S, pg_timeout_s / 2)


def _tenths_up(seconds: float) -> str:
    """``seconds`` to a tenth, rounded up: a silence just past the threshold never reads as
    shorter than the threshold it crossed (10.502 s after a 10.502 s threshold is "10.6")."""
    return f"{math.ceil(seconds * 10) / 10:.1f}"


def detection_bound_s(stall_s: float = DEFAULT_STALL_S, interval_s: float = DEFAULT_INTERVAL_S) -> float:
    """How long after a peer stops it is named, at most."""
    return stall_s + 2 * interval_s


class _Watch:
    def __init__(self, store, rank: int, world: int, stall_s: float, interval_s: float, what: str) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.stall_s, self.interval_s, self.what = stall_s, interval_s, what
        self.prefix = f"{_PREFIX}/{next(_watches)}"
        self.host, self.pid, self.namespace = socket.gethostname(), os.getpid(), _pid_namespace()
        now = time.monotonic()
        self.seen: dict[int, tuple[str | None, float]] = {r: (None, now) for r in range(world) if r != rank}
        self.who: dict[int, str] = {}
        self.processes: dict[int, tuple[str, int, str]] = {}  # peer -> (host, pid, PID namespace)
        self.beats_seen: dict[int, int] = {r: 0 for r in self.seen}  # new values read, per peer
        self.done: set[int] = set()
        self.store_ok = now
        self.verdict: str | None = None
        self.handling = threading.Event()  # the main thread is in __exit__ with an error: it raises
        self.stop = threading.Event()
        self.lock = threading.Lock()

    # --- the beat and the look, on one thread, over the watch's own store client ---

    def _publish(self, beat: int) -> None:
        self.store.set(f"{self.prefix}/{self.rank}", f"{beat} {self.host} {self.pid} {self.namespace}")

    def _beat_and_look(self) -> None:
        beat = 1  # beat 0 was published by ``start``, before the block
        while not self.stop.is_set():
            try:
                self._publish(beat)
                beat += 1
                for peer in list(self.seen):
                    self._look(peer)
                with self.lock:
                    self.store_ok = time.monotonic()
            except Exception:  # noqa: BLE001 - a store that fails is judged by store_ok's age
                pass
            self.stop.wait(self.interval_s)
        # The last word, from this thread: a beat can then never land after "done".
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}/{self.rank}", f"done {self.host} {self.pid} {self.namespace}")

    def _look(self, peer: int) -> None:
        """Read ``peer``'s latest beat (or its last word, "done") from the store and record it."""
        key = f"{self.prefix}/{peer}"
        if peer in self.done or not self.store.check([key]):
            return
        value = self.store.get(key).decode()
        count, host, pid, namespace = (value.split(" ", 3) + [""])[:4]
        with self.lock:
            self.who[peer] = f"host {host}, pid {pid}"
            self.processes[peer] = (host, int(pid), namespace)
            if count == "done":
                self.done.add(peer)
            elif value != self.seen[peer][0]:
                self.seen[peer] = (value, time.monotonic())
                self.beats_seen[peer] += 1

    # --- the judge, on another thread: local state only (but for re-reading the last word of a
    # peer whose process is gone), so a blocked store cannot block it ---

    def _stalled(self) -> str | None:
        now = time.monotonic()
        with self.lock:
            late = sorted((now - since, peer) for peer, (_, since) in self.seen.items() if peer not in self.done)
            if late and late[-1][0] >= self.stall_s:
                silent, peer = late[-1]
                who = self.who.get(peer, "no beat ever received")
                return (
                    f"rank {peer} ({who}) stopped answering: no heartbeat for {_tenths_up(silent)} s {self.what} "
                    f"(a peer is named after {self.stall_s:g} s without one, within "
                    f"{detection_bound_s(self.stall_s, self.interval_s):g} s)"
                )
            if now - self.store_ok >= self.stall_s:
                return (
                    f"the job's store stopped answering rank {self.rank} for {now - self.store_ok:.1f} s "
                    f"{self.what}; its host (torchrun's MASTER_ADDR {os.environ.get('MASTER_ADDR', '?')}) "
                    "is stalled or gone"
                )
        return None

    def look_at_everyone(self) -> None:
        """Read every peer's latest beat now, from the calling thread (once the beat has stopped,
        or where a starved beat thread may not have read a peer yet): who each peer is must be
        known before a gone one can be named."""
        for peer in list(self.seen):
            with contextlib.suppress(Exception):
                self._look(peer)

    def gone(self) -> str | None:
        """A peer whose process has ended, seen at once where it can be: on this host and in this
        PID namespace (torchrun's ranks of one node), where its pid is absent or a zombie. Not a
        judgement on silence: certain, so it needs no wait (a peer on another node is named by
        its silence, or not at all)."""
        with self.lock:
            processes = {p: v for p, v in self.processes.items() if p not in self.done}
        for peer, (host, pid, namespace) in sorted(processes.items()):
            if host == self.host and namespace and namespace == self.namespace and _process_gone(pid):
                # Its last word may have come since the beat thread looked: a peer that left the
                # block itself (with its own error, which it reports) said "done" before it ended.
                with contextlib.suppress(Exception):
                    self._look(peer)
                with self.lock:
                    if peer in self.done:
                        continue
                return f"rank {peer} ({self.who[peer]}) ended {self.what}: its process is gone"
        return None

    def gone_after_signal(self) -> str | None:
        """After this rank got SIGINT / SIGTERM: a peer whose process ended without its last word.
        A Ctrl-C reaches every rank, and a rank stopped by it says "done" as it leaves: a peer
        gone before this rank looked is then no news. So this rank stops beating first (its own
        last word tells its peers the same), then reads its gone peers' keys for up to
        ``SIGNAL_WORD_BEATS`` intervals; one still without a "done" (killed outright) is named."""
        self.finish()
        # A beat thread starved on a busy machine may not have read a peer yet: read them all
        # here first (torchrun's SIGTERM can come within 0.1 s of a peer's death).
        self.look_at_everyone()
        deadline = time.monotonic() + SIGNAL_WORD_BEATS * self.interval_s
        while (verdict := self.gone()) is not None and time.monotonic() < deadline:
            time.sleep(min(self.interval_s, 0.1))
            self.look_at_everyone()  # from this thread: the beat has stopped
        return verdict

    def _judge(self) -> None:
        gone_since = None
        while not self.stop.wait(self.interval_s):
            verdict = self._stalled()
            if verdict is None:
                # A peer's process gone: a main thread that can raise (the backend's error,
                # torchrun's SIGTERM) names it itself within moments; one blocked in the backend
                # (a wait on the dead peer) cannot, and torchrun's SIGKILL would end it without
                # a word: named here once the main thread has had GONE_GRACE_BEATS intervals.
                gone = self.gone()
                gone_since = (gone_since or time.monotonic()) if gone else None
                if gone is None or time.monotonic() - gone_since < GONE_GRACE_BEATS * self.interval_s:
                    continue
                verdict = gone
            self.verdict = verdict
            if self.handling.is_set():
                return  # the main thread raises it
            # The main thread is blocked in a collective and cannot raise: end the process.
            print(f"error (rank {self.rank}): {verdict}", file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)

    def start(self) -> None:
        """Publish the first beat from the calling thread, before the block: once any rank is
        inside, every peer that entered can be named by host and pid, however late the beat
        threads run (a store that fails now is judged by the beat thread, as any later beat)."""
        with contextlib.suppress(Exception):
            self._publish(0)
        self.beater = threading.Thread(target=self._beat_and_look, name="fsdp_fp8-heartbeat-beat", daemon=True)
        self.beater.start()
        threading.Thread(target=self._judge, name="fsdp_fp8-heartbeat-judge", daemon=True).start()

    def finish(self) -> None:
        """Stop beating; the beat thread says "done" as its last write. Waits for it at most
        one stall (a store that stopped answering must not hold the rank's exit)."""
        self.stop.set()
        self.beater.join(timeout=min(self.stall_s, 5 * self.interval_s))

    def wait_for_verdict(self) -> str | None:
        """After the block raised: who, if anyone, stopped beating. Waits until every peer has
        beaten twice since the error (then they are alive, and the error is this rank's own or
        a peer's that it will report itself: None), or up to the bound, when a late peer is named
        (a peer killed outright stops at once; its last beat may have been seen after the
        error, so a quiet gap of a few beats is not proof of life). At most twice the bound."""
        start = time.monotonic()
        # Past the bound by as much again: the beat thread itself may have been starved, so the
        # silent peer's last beat can have been read well after the error (a busy machine).
        deadline = start + 2 * detection_bound_s(self.stall_s, self.interval_s)
        with self.lock:
            before = dict(self.beats_seen)
        while time.monotonic() < deadline:
            verdict = self.verdict or self.gone() or self._stalled()
            if verdict is not None:
                return verdict
            with self.lock:
                # two new beats: a dead peer's last one can still be read once after the error
                silent = [p for p in self.seen if p not in self.done and self.beats_seen[p] - before[p] < 2]
            if not silent:
                return None
            time.sleep(min(self.interval_s, 0.1))
        return self.verdict or self._stalled()

    def verdict_after(self, exc: BaseException) -> str | None:
        """Who, if anyone, is gone or silent after the block raised ``exc``. For an error, what
        the beats say (``wait_for_verdict``); for a signal (torchrun stops the other ranks once
        one has died), only what is certain at once: a peer whose process is gone. A signal while
        waiting is re-raised unless a peer is gone. An agreed error (or one found before any
        collective) is no lost peer's doing, even once the peer that prints it has exited."""
        if isinstance(exc, ProblemsError):
            return None
        if not isinstance(exc, Exception):
            return self.gone_after_signal()
        try:
            return self.wait_for_verdict()
        except BaseException:
            self.look_at_everyone()
            verdict = self.gone()
            if verdict is None:
                raise
            return verdict


def _pid_namespace() -> str:
    """This process's PID namespace (``pid:[4026531836]``), or "" where it cannot be read: two
    processes' pids compare only within one namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended: no such process, or a zombie its parent has not reaped
    (torchrun's agent reaps a dead rank only when it next looks)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[:1]
    except FileNotFoundError:
        return True
    except OSError:  # no /proc, or hidden from us: not known to be gone
        return False
    return state in (["Z"], ["X"])


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (a group without one): nothing to beat on
        return None


def own_client(store):
    """A client of ``store`` for the watch alone: a TCPStore client holds one lock for a whole
    ``wait()``, so a main thread waiting in the store (a late peer at the agreement) would block
    the beats on a shared client and get live ranks named as stalled. ``clone()`` opens a new
    connection to the same server (and keeps a PrefixStore's prefix); a store that cannot be
    cloned (a FileStore, a torch without ``clone``) is shared: its operations do not hold a
    lock across a wait."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception:  # noqa: BLE001 - "not implemented" for this store type
        return store


@contextlib.contextmanager
def watch_peers(
    stall_s: float = DEFAULT_STALL_S, interval_s: float = DEFAULT_INTERVAL_S, what: str = "during generation"
) -> Iterator[None]:
    """Name a peer that stops answering inside this block (see the module's docstring).

    Collective in spirit: every rank enters it around the same work. A single process, or a
    group without a store, runs the block unwatched."""
    if stall_s <= 0 or interval_s <= 0:
        raise ArgumentError(f"watch_peers needs stall_s and interval_s > 0, got {stall_s} and {interval_s}")
    store = _store() if dist.is_available() and dist.is_initialized() else None
    if store is None or dist.get_world_size() == 1:
        yield
        return
    watch = _Watch(own_client(store), dist.get_rank(), dist.get_world_size(), stall_s, interval_s, what)
    watch.start()
    try:
        yield
    except BaseException as exc:
        watch.handling.set()
        verdict = watch.verdict_after(exc)
        watch.stop.set()
        if verdict is None:
            raise
        if isinstance(exc, Exception):
            raise PeerLostError(f"{verdict}; the collective then failed: {type(exc).__name__}: {exc}") from exc
        raise PeerLostError(f"{verdict}; this rank was then {exc or type(exc).__name__}") from exc
    finally:
        watch.finish()
