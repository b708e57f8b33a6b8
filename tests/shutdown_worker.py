"""Run under torchrun by tests/distributed/test_shutdown.py: the minimal FSDP2 + gloo exit-abort case.

A small ``nn.Sequential`` of Linears, ``fully_shard``-ed per layer and at the root, one
forward, then ``shutdown_distributed(0)`` (``--exit-code N``: the failure path), or, with ``--plain-exit``, a plain
``destroy_process_group()`` and a normal interpreter exit, to reproduce the abort; see
docs/shutdown.md). Prints the output checksum, which every rank must agree on.
"""

from __future__ import annotations

import argparse
import atexit
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_fp8.runtime.shutdown import shutdown_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain-exit", action="store_true")
    parser.add_argument("--exit-code", type=int, default=0, help="non-zero: the failure path (abort)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    with torch.no_grad():
        expected = model(torch.ones(2, 16))  # same seed on every rank: the unsharded reference
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    with torch.no_grad():
        y = model(torch.ones(2, 16))
    print(f"rank {rank} exact {torch.equal(y, expected)} sum {y.sum().item():.6f}", flush=True)
    # Both must still come out: shutdown_distributed runs atexit handlers and shuts logging down.
    atexit.register(print, f"rank {rank} atexit ran")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("shutdown_worker").info("rank %d logged before exit", rank)
    if args.plain_exit:
        dist.destroy_process_group()
        return
    if args.exit_code:  # the failure path must abort: a destroy here is reported
        dist.destroy_process_group = lambda *a, **k: print(f"rank {rank} destroy_process_group called", flush=True)
    shutdown_distributed(args.exit_code)
    raise AssertionError("shutdown_distributed returned")


if __name__ == "__main__":
    main()
