"""``load_model``: the one-call path from a checkpoint directory to a loaded, sharded model.

    open -> build on meta -> plan -> ranks agree -> swap FP8 linears -> fully_shard
    (blocks, then root) -> to_empty (non-persistent buffers kept) -> rank-slice load
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_fp8.agreement import agree_or_raise, checkpoint_identity
from fsdp_fp8.checkpoint import open_checkpoint
from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.fsdp_wrap import default_mesh, shard_model
from fsdp_fp8.loader import LoadReport, load_checkpoint
from fsdp_fp8.meta_build import materialize, meta_init
from fsdp_fp8.swap import swap_fp8_linears

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    checkpoint: object
    plan: object
    report: LoadReport
    fp8_linears: list[str]


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _open_and_plan(model_fn, path, key_map, strict):
    checkpoint = open_checkpoint(path)
    with meta_init():
        model = model_fn(checkpoint.config)
    plan = checkpoint.plan(model, key_map=key_map, strict=strict)
    return checkpoint, model, plan


def load_model(
    model_fn: Callable[[dict], nn.Module],
    path: str | os.PathLike,
    mesh: DeviceMesh | None = None,
    key_map: Callable[[str], str | None] | None = None,
    *,
    device: torch.device | None = None,
    strict: bool = True,
) -> LoadedModel:
    """Build ``model_fn(config_dict)`` on meta and load the checkpoint at ``path`` into it.

    With a process group up, this is collective: the model is ``fully_shard``-ed over
    ``mesh`` (default: every rank) and each rank loads only its rows. Without one, it
    loads a plain single-process model. Every rank raises the same error if any rank
    finds a problem, before anything is swapped, sharded or read.
    """
    device = device or default_device()
    distributed = dist.is_available() and dist.is_initialized()
    checkpoint = model = plan = None
    problems: list[str] = []
    try:
        checkpoint, model, plan = _open_and_plan(model_fn, path, key_map, strict)
    except CheckpointError as exc:
        problems = exc.problems
    except (OSError, ValueError, KeyError, TypeError) as exc:
        problems = [f"{type(exc).__name__}: {exc}"]
    identity = checkpoint_identity(checkpoint) if checkpoint is not None else None
    agree_or_raise(problems, identity, f"cannot load {path}")

    swapped = swap_fp8_linears(model, plan)
    if distributed:
        shard_model(model, mesh or default_mesh(device.type))
    materialize(model, device)
    report = load_checkpoint(model, checkpoint, plan)
    model.eval()
    return LoadedModel(model=model, checkpoint=checkpoint, plan=plan, report=report, fp8_linears=swapped)
