"""bench.harness's process starters: a function on spawned gloo ranks returns each rank's result
from one process group with one thread per rank, and a trial child that never answers, or ends
without a word, is reported by its rank while the others' results are kept."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from bench import harness


def _group_facts(rank: int, world: int, tag: str) -> tuple:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank])
    dist.all_reduce(total)
    return tag, dist.get_world_size(), int(total), torch.get_num_threads()


def test_spawn_ranks_runs_the_function_on_every_rank_of_one_group():
    results = harness.spawn_ranks(_group_facts, 3, "x", timeout=180)
    assert results == {rank: ("x", 3, 0 + 1 + 2, 1) for rank in range(3)}


def _answer(rank: int, conn) -> None:
    conn.send({"rank": rank, "pid": os.getpid()})
    conn.close()


def _silent(rank: int, conn) -> None:
    time.sleep(3600)  # never answers: killed at the deadline, not waited for


def _gone(rank: int, conn) -> None:
    os._exit(3)  # ends without a word, as a rank killed for memory does


def test_run_children_reports_silent_and_vanished_children_and_keeps_the_others():
    from calibration import bound

    deadline = bound(2)  # time for the answering children to start (0.2 s on a quiet machine)
    children = [(0, _answer, (0,)), (1, _silent, (1,)), (2, _gone, (2,)), (3, _answer, (3,))]
    start = time.monotonic()
    results = harness.run_children(mp.get_context("spawn"), children, timeout=deadline)
    # The silent child was killed at the deadline: the join of the others would have waited JOIN_S for it.
    assert time.monotonic() - start < deadline + harness.JOIN_S
    assert results[1] == {"rank": 1, "error": "timed out"}
    assert results[2]["rank"] == 2 and "without a result" in results[2]["error"]
    assert [r["rank"] for r in results] == [0, 1, 2, 3] and "pid" in results[0] and "pid" in results[3]
