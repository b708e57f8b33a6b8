"""Stalled peers named during generation (fsdp_fp8.runtime.heartbeat), at 2 gloo ranks: each
rank in turn stopped (SIGSTOP) or killed (SIGKILL) between two collectives, while the other
waits in the next one with the process group's default timeout (30 minutes): the live rank is
told which rank stopped, on which host, and exits non-zero, long before any transport timeout.
No false alarms: a peer that is slow but alive, or one that left the block early, is not named
(3 ranks, both in one run).

The tests last what they judge, no more: a stopped rank is ended by the harness once the live
rank has failed; a wait for a beat thread to have read a peer is a condition, not a sleep; a beat
thread starved on a busy machine is made exact by skipping its reads (``_watched``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time

import pytest
from calibration import bound
from ranks import RanksFailed, run_ranks

INTERVAL_S = 0.25


def _stall_s() -> float:
    # Short for the test (the stopped-rank tests last it), scaled with the machine: a starved
    # heartbeat thread is no stall.
    return bound(1.5)


def _generate(rank: int, world: int, victim: int, how: str, stall_s: float):
    import torch
    import torch.distributed as dist

    from fsdp_fp8.runtime.heartbeat import watch_peers

    with watch_peers(stall_s=stall_s, interval_s=INTERVAL_S):
        for step in range(6):
            if rank == victim and step == 3:
                if how == "raise":
                    raise ValueError(f"rank {rank}'s own error")
                os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
            t = torch.ones(1)
            dist.all_reduce(t)  # the live rank waits here for the victim
    return "finished"


def _slow_beside_one_that_left(rank: int, world: int, stall_s: float, slow_s: float):
    """At 3 ranks, both false alarms in one run: rank 0 leaves the block after the first
    collectives (it stops beating; its last word says so) and ends; rank 2 then sleeps ``slow_s``
    between two collectives of ranks 1 and 2 (alive: its heartbeat thread beats on) while rank 1
    waits in the next. Ranks 1 and 2 stay inside the block ``slow_s`` after rank 0 left it."""
    import torch
    import torch.distributed as dist

    from fsdp_fp8.runtime.heartbeat import watch_peers

    pair = dist.new_group([1, 2])  # every rank takes part in making it
    with watch_peers(stall_s=stall_s, interval_s=INTERVAL_S):
        for step in range(3):
            dist.all_reduce(torch.ones(1))
        for step in range(3 if rank > 0 else 0):
            if rank == 2 and step == 1:
                time.sleep(slow_s)
            dist.all_reduce(torch.ones(1), group=pair)  # rank 1 waits here for rank 2
    return "finished"


@contextlib.contextmanager
def _watched(starved: bool = False, **kwargs):
    """``watch_peers(**kwargs)``, yielding its watch and an event: once the event is set (from the
    start with ``starved``), the watch's beat thread reads no peer, as a thread starved on a busy
    machine; it still beats, and the rank's other threads still read (where a long interval would
    only make that likely, and last as long)."""
    from unittest import mock

    from fsdp_fp8.runtime import heartbeat

    watches, starve = [], threading.Event()
    if starved:
        starve.set()
    real_start = heartbeat._Watch.start

    def start(watch):
        real_look = watch._look

        def look(peer: int) -> None:
            if not (starve.is_set() and threading.current_thread() is watch.beater):
                real_look(peer)

        watch._look = look
        watches.append(watch)
        real_start(watch)

    with mock.patch.object(heartbeat._Watch, "start", start), heartbeat.watch_peers(**kwargs):
        yield watches[0], starve


def _until_read(watch, peer: int) -> None:
    """Until ``watch``'s beat thread has read ``peer``'s beat (its host and pid)."""
    deadline = time.monotonic() + bound(30.0)
    while peer not in watch.processes:
        assert time.monotonic() < deadline, f"rank {watch.rank}'s watch never read rank {peer}'s beat"
        time.sleep(0.01)


def _signalled_while_watched(rank: int, kill_rank_1: bool, signum: int, settle: bool, starve_rank_0: bool):
    """Both ranks in a watch with signal handlers installed (as the launcher's ranks are); with
    ``settle``, each rank's beat thread has read the other's beat first; with ``starve_rank_0``,
    rank 0's beat thread reads no peer from then on (from the start, without ``settle``). Rank 1
    is then killed (SIGKILL) or sent ``signum``; rank 0 is sent ``signum`` once rank 1's process
    is gone (within 0.1 s, as torchrun's SIGTERM can come)."""
    import torch
    import torch.distributed as dist

    from fsdp_fp8.cli import interrupts

    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    interrupts.install()
    starved = starve_rank_0 and not settle and rank == 0
    with _watched(starved, stall_s=bound(30.0), interval_s=INTERVAL_S) as (watch, starve):
        if settle:
            _until_read(watch, 1 - rank)
            if starve_rank_0 and rank == 0:
                starve.set()
        dist.all_reduce(torch.ones(1))  # neither goes on before both have read (or not) the other
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL if kill_rank_1 else signum)
        while _alive(pids[1]):
            time.sleep(0.05)
        os.kill(os.getpid(), signum)
        time.sleep(60)  # not reached: the handler raises
    return "finished"


def _stopped_after_the_peer_died(rank: int, world: int):
    """Rank 1 dies between two collectives; rank 0, inside no collective, is then sent SIGTERM,
    as torchrun sends it to the other ranks once one has died."""
    return _signalled_while_watched(rank, True, signal.SIGTERM, settle=True, starve_rank_0=False)


def _stopped_before_its_beat_thread_read_the_peer(rank: int, world: int):
    """As ``_stopped_after_the_peer_died``, but rank 0's beat thread never read rank 1's beat (a
    thread starved on a busy machine) when torchrun's SIGTERM comes."""
    return _signalled_while_watched(rank, True, signal.SIGTERM, settle=False, starve_rank_0=True)


def _the_same_error_one_after_the_other(rank: int, world: int):
    """Every rank fails on the same input inside the watch: rank 0 at once (it waits for rank 1's
    beats, says its last word and exits, as the launcher's rank 0 does once it has printed), rank
    1 once rank 0's process is gone, its beat thread having read rank 0's beat but nothing since
    (starved)."""
    import torch
    import torch.distributed as dist

    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    with _watched(stall_s=bound(30.0), interval_s=INTERVAL_S) as (watch, starve):
        _until_read(watch, 1 - rank)
        if rank == 1:
            starve.set()
        dist.all_reduce(torch.ones(1))  # rank 0 fails only once rank 1's beat thread is starved
        if rank == 1:
            while _alive(pids[0]):
                time.sleep(0.02)
        raise ValueError("the same bad input on every rank")


def _blocked_in_the_backend_when_the_peer_died(rank: int, world: int):
    """Rank 0's main thread blocked in a backend wait (a store wait on a key only the dead peer
    would set: it cannot raise, nor run a signal handler); rank 1 killed once both are inside."""
    import datetime

    import torch.distributed as dist

    from fsdp_fp8.runtime.heartbeat import watch_peers

    store = dist.distributed_c10d._get_default_store()
    with watch_peers(stall_s=bound(60.0), interval_s=INTERVAL_S):
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        store.wait(["never set"], datetime.timedelta(seconds=bound(120.0)))
    return "finished"


def _both_stopped_one_after_the_other(rank: int, world: int):
    """A Ctrl-C reaches every rank, one a little before the other: rank 1 is stopped first and
    leaves; rank 0, stopped once rank 1's process is gone, finds a peer gone that said its last
    word as it left (its beat thread, starved, has not read it since rank 1's first beat)."""
    return _signalled_while_watched(rank, False, signal.SIGINT, settle=True, starve_rank_0=True)


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(text: str, victim: int) -> None:
    """The certain verdict: the victim's process is gone, named at once (no silence waited for)."""
    host = re.escape(socket.gethostname())
    assert re.search(rf"rank {victim} \(host {host}, pid \d+\) ended during generation: its process is gone", text)


def _named(text: str, victim: int, stall_s: float) -> None:
    found = re.search(
        rf"rank {victim} \(host {re.escape(socket.gethostname())}, pid \d+\) stopped answering: "
        rf"no heartbeat for ([0-9.]+) s during generation \(a peer is named after [0-9.]+ s without one, within",
        text,
    )
    assert found, text
    assert float(found.group(1)) >= stall_s  # named after the stated silence, never before


@pytest.mark.parametrize("victim", [0, 1])
def test_a_stopped_rank_is_named_and_the_live_rank_exits_non_zero(victim, capfd):
    stall_s = _stall_s()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_generate, 2, victim, "stop", stall_s, timeout=300)
    live = 1 - victim
    message = str(info.value)
    assert f"rank {live} exited with code 1 before returning a result" in message, message
    assert f"rank {victim} returned no result and was killed" in message, message  # stopped: only the harness ends it
    assert "timed out" not in message, message  # ended by the watcher, not by the harness's timeout
    err = capfd.readouterr().err
    assert f"error (rank {live}): " in err, err
    _named(err, victim, stall_s)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_rank_is_named_by_the_live_rank(victim, monkeypatch):
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 60.0)  # the live rank must be let to report
    stall_s = _stall_s()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_generate, 2, victim, "kill", stall_s, timeout=300)
    live = 1 - victim
    message = str(info.value)
    assert f"rank {victim} died of SIGKILL before returning a result" in message, message
    assert f"rank {live} raised:" in message and "PeerLostError: " in message, message
    _gone(message, victim)
    assert "the collective then failed: " in message  # gloo's own error, kept


def test_a_rank_stopped_after_a_peer_died_names_the_peer(monkeypatch):
    """A rank inside no collective when torchrun stops it (its own compute, a CFG pair's turn)
    used to say only `stopped by SIGTERM`; the dead peer's process is gone, so it is named."""
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 60.0)
    with pytest.raises(RanksFailed) as info:
        run_ranks(_stopped_after_the_peer_died, 2, timeout=300)
    message = str(info.value)
    assert "rank 1 died of SIGKILL before returning a result" in message, message
    assert "rank 0 raised:" in message and "PeerLostError: " in message, message
    _gone(message, 1)
    assert "this rank was then stopped by SIGTERM" in message, message


def test_a_peer_killed_before_the_beat_thread_read_it_is_named(monkeypatch):
    """CI once printed only `stopped by SIGTERM` for a rank killed under the launcher's
    --cfg-parallel: the survivor's beat thread, starved, had not read the peer's beat, so it knew
    no pid to find gone. The first beat is now published before the block, and the signalled
    rank reads every peer itself before it judges."""
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 60.0)
    with pytest.raises(RanksFailed) as info:
        run_ranks(_stopped_before_its_beat_thread_read_the_peer, 2, timeout=300)
    message = str(info.value)
    assert "rank 0 raised:" in message and "PeerLostError: " in message, message
    _gone(message, 1)


def test_a_peer_that_failed_on_the_same_input_and_ended_is_not_named(monkeypatch):
    """Issue 49: a truncated image failed every rank, and rank 1 once reported rank 0 as "ended
    during the pipeline's load or generation" (rank 0 had printed the error and exited). A peer
    whose last word is in the store left the block itself: each rank raises its own error."""
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 60.0)
    with pytest.raises(RanksFailed) as info:
        run_ranks(_the_same_error_one_after_the_other, 2, timeout=300)
    message = str(info.value)
    assert message.count("ValueError: the same bad input on every rank") == 2, message
    assert "PeerLostError" not in message and "its process is gone" not in message, message


def test_a_rank_blocked_in_the_backend_names_a_peer_whose_process_is_gone(monkeypatch, capfd):
    """CI once saw rank 0 end without a word after rank 1 was killed: its main thread waited in
    the backend, where neither an error nor torchrun's SIGTERM reaches it, until torchrun's
    SIGKILL. The watcher names the gone peer itself (well before its 60 s stall threshold)."""
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 60.0)
    with pytest.raises(RanksFailed) as info:
        run_ranks(_blocked_in_the_backend_when_the_peer_died, 2, timeout=300)
    message = str(info.value)
    assert "rank 0 exited with code 1 before returning a result" in message, message
    err = capfd.readouterr().err
    assert "error (rank 0): " in err and "stopped answering" not in err, err
    _gone(err, 1)


def test_a_peer_stopped_by_the_same_signal_is_not_named(monkeypatch):
    """Ctrl-C under torchrun: a rank that meets the signal after its peer already left must not
    report the peer as lost (it was, once, named: "rank 1 ... ended ...: its process is gone")."""
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 60.0)
    with pytest.raises(RanksFailed) as info:
        run_ranks(_both_stopped_one_after_the_other, 2, timeout=300)
    message = str(info.value)
    assert "rank 0 raised:" in message and "rank 1 raised:" in message, message
    assert message.count("Interrupted: stopped by SIGINT") == 2, message
    assert "PeerLostError" not in message and "its process is gone" not in message, message


def test_an_agreed_error_is_not_blamed_on_a_peer_that_left_with_it():
    """An agreed error (every rank found the same problems) is no lost peer's doing, even when the
    peer that prints it has already exited; it was once reported by rank 1 as "rank 0 ... ended
    during the model's load or run: its process is gone" under the launcher. One process: rank
    1's watch has read the beat of a rank 0 whose process has ended, not yet its last word."""
    import subprocess
    import sys

    import torch.distributed as dist

    from fsdp_fp8.errors import CheckpointError
    from fsdp_fp8.runtime import heartbeat

    store = dist.HashStore()
    watch = heartbeat._Watch(store, 1, 2, bound(30.0), INTERVAL_S, "during the model's load or run")
    watch.handling.set()  # a verdict is recorded for the test instead of ending the process
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(ended.stdout)  # the peer that printed the shared error and left
    store.set(f"{watch.prefix}/0", f"0 {watch.host} {pid} {watch.namespace}")
    watch.start()
    try:
        deadline = time.monotonic() + bound(10.0)
        while 0 not in watch.processes and time.monotonic() < deadline:
            time.sleep(0.01)
        agreed = CheckpointError(["model.safetensors: truncated"], "cannot load ckpt")
        assert watch.verdict_after(agreed) is None
        # The same watch names the gone peer for an error that is not agreed (a failed collective).
        gone = watch.verdict_after(RuntimeError("Connection closed by peer"))
        assert (
            gone == f"rank 0 (host {watch.host}, pid {pid}) ended during the model's load or run: its process is gone"
        )
    finally:
        watch.finish()


def test_a_slow_peer_or_one_that_left_early_is_not_named():
    stall_s = _stall_s()
    # Rank 2 sleeps 1.5 stall_s between two collectives; rank 0 has left the block (and stopped
    # beating) before it: rank 1 judges both, rank 2 the one that left.
    assert run_ranks(_slow_beside_one_that_left, 3, stall_s, 1.5 * stall_s, timeout=300) == ["finished"] * 3


def test_an_error_of_a_rank_s_own_is_raised_unchanged():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_generate, 2, 1, "raise", _stall_s(), timeout=300)
    message = str(info.value)
    assert "ValueError: rank 1's own error" in message and "stopped answering" not in message, message


def test_the_bound_and_a_single_process():
    from fsdp_fp8.runtime import heartbeat

    assert heartbeat.detection_bound_s() == heartbeat.DEFAULT_STALL_S + 2 * heartbeat.DEFAULT_INTERVAL_S == 32.0
    with heartbeat.watch_peers():  # no process group: the block runs unwatched
        pass
    with pytest.raises(ValueError, match="stall_s and interval_s > 0, got 0 and 1.0"):
        with heartbeat.watch_peers(stall_s=0):
            pass


def test_a_main_thread_waiting_in_the_store_does_not_stop_the_beats():
    """A rank waiting in the store (the side group's arrival wait for a late peer) must keep
    beating: a TCPStore client holds its lock for a whole ``wait()``, so the watch needs a
    client of its own. One process: a peer beats on its own client, the main thread waits
    in the store for longer than the stall threshold, and nobody may be judged stalled."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from fsdp_fp8.runtime import heartbeat

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    main_client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    stall_s = 1.0
    watch = heartbeat._Watch(heartbeat.own_client(main_client), 0, 2, stall_s, 0.1, "in the test")
    watch.handling.set()  # a verdict is recorded for the test instead of ending the process
    peer_client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    peer_stop = threading.Event()

    def peer_beats():
        beat = 0
        while not peer_stop.wait(0.1):
            peer_client.set(f"{watch.prefix}/1", f"{beat} peerhost 999")
            beat += 1

    peer = threading.Thread(target=peer_beats, daemon=True)
    peer.start()
    watch.start()
    try:
        with pytest.raises(Exception, match="(?i)timeout|timed out"):
            main_client.wait(["never set"], timedelta(seconds=3 * stall_s))
        assert watch.verdict is None and watch._stalled() is None, watch.verdict
        assert watch.beats_seen[1] >= 10  # the watch kept reading the peer's beats meanwhile
    finally:
        peer_stop.set()
        watch.finish()
        peer.join()
    assert main_client.get(f"{watch.prefix}/0").decode().startswith("done ")  # the last word
