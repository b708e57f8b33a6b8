"""What is checked before a load touches a process group or a device: whether this process is
one of several ranks without a process group, and whether its GPU can take the load.

The device checks are a pure function of the device facts (``DeviceFacts``): what the caller
asked for, what torch and the launcher say, so they are tested on a machine without a GPU by
handing in the facts of one. Their problems join the agreement before loading, so every rank
raises the same error.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fsdp_fp8.collective import distributed, rank_and_world, side_group
from fsdp_fp8.load.fsdp_wrap import mesh_problems

log = logging.getLogger(__name__)

W8A8_CAPABILITY = (8, 9)  # torch._scaled_mm's FP8 GEMM: Ada (sm89), Hopper (sm90) and later


def _env_int(env, name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


def start_process_group(timeout_s: float, env=os.environ) -> None:
    """The default process group this rank joins under a launcher: gloo on CPU; on CUDA, NCCL bound
    to this rank's GPU (``LOCAL_RANK`` modulo the visible GPUs), made current first. ``device_id``
    makes NCCL build its communicator now, so a missing peer or a bad device fails here rather
    than in the first all-gather. The one place fsdp_fp8 starts a process group."""
    timeout = timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", _env_int(env, "LOCAL_RANK", 0) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def ensure_process_group(timeout_s: float, env=os.environ) -> bool:
    """Under a launcher of several ranks (``WORLD_SIZE`` > 1) with no process group yet, start one
    (``start_process_group``); True when it did. Without it every rank would load the whole
    model, unsharded."""
    if _env_int(env, "WORLD_SIZE", 1) <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    start_process_group(timeout_s, env)
    if dist.get_rank() == 0:
        log.warning(
            "WORLD_SIZE=%s but no process group was set up: fsdp_fp8 initialized one (%s) so the model "
            "is sharded; call torch.distributed.destroy_process_group() when done",
            env.get("WORLD_SIZE"),
            dist.get_backend(),
        )
    return True


def join_ranks(what: str, timeout_s: float) -> None:
    """Before any rank can fail or die: a process group under torchrun (never a silent unsharded
    load per rank), and the gloo side group every agreement runs on (collective). ``what`` names
    the work in a late peer's error (``cannot load DIR``)."""
    ensure_process_group(timeout_s)
    if distributed():
        side_group(timeout_s, what)


@dataclass(frozen=True)
class DeviceFacts:
    """What decides whether this rank's GPU can take the load."""

    device: torch.device  # where the load goes (the caller's, or ``default_device()``)
    current_index: int | None  # torch.cuda.current_device(); None without CUDA
    capability: tuple[int, int] | None  # of ``device``; None without CUDA
    visible_devices: int  # torch.cuda.device_count()
    local_rank: int  # LOCAL_RANK
    local_world_size: int  # LOCAL_WORLD_SIZE: ranks on this node
    cuda_visible_devices: str | None  # CUDA_VISIBLE_DEVICES, as the launcher set it
    fp8_linears: int  # the load's FP8 linears (W8A8 at the policy's native steps)
    nccl: bool = False  # the default process group is NCCL (its collectives use the current device)


def device_facts(device: torch.device, fp8_linears: int, env=os.environ) -> DeviceFacts:
    """The facts of this process, read from torch and the environment."""
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    cuda = device.type == "cuda" and torch.cuda.is_available()
    index = device.index if device.index is not None else (torch.cuda.current_device() if cuda else None)
    visible = torch.cuda.device_count() if cuda else 0
    exists = cuda and 0 <= index < visible  # torch asserts on a device it does not see: a problem instead
    return DeviceFacts(
        device=device,
        current_index=torch.cuda.current_device() if cuda else None,
        capability=tuple(torch.cuda.get_device_capability(index)) if exists else None,
        visible_devices=visible,
        local_rank=_env_int(env, "LOCAL_RANK", 0),
        local_world_size=_env_int(env, "LOCAL_WORLD_SIZE", 1),
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        fp8_linears=fp8_linears,
        nccl=nccl,
    )


def device_problems(facts: DeviceFacts) -> list[str]:
    """Why this rank's GPU cannot take the load (empty: it can, or the load is not onto CUDA)."""
    if facts.device.type != "cuda":
        return []
    problems = []
    index = facts.device.index
    if index is not None and facts.visible_devices and index >= facts.visible_devices:
        return [
            f"this rank loads onto {facts.device} but this process sees {facts.visible_devices} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={facts.cuda_visible_devices or '(unset)'}); with one visible GPU per rank "
            "pass device=None (fsdp_fp8 takes LOCAL_RANK modulo the visible GPUs) or cuda:0"
        ]
    if facts.fp8_linears and facts.capability is not None and tuple(facts.capability) < W8A8_CAPABILITY:
        major, minor = facts.capability
        problems.append(
            f"{facts.device} has compute capability {major}.{minor}; the {facts.fp8_linears} FP8 linears run "
            f"W8A8 (torch._scaled_mm) at the step policy's native steps, which needs >= "
            f"{W8A8_CAPABILITY[0]}.{W8A8_CAPABILITY[1]} (Ada, Hopper or later)"
        )
    shared = facts.visible_devices and facts.local_world_size > facts.visible_devices
    if shared and (facts.visible_devices > 1 or not facts.cuda_visible_devices):
        problems.append(
            f"{facts.local_world_size} ranks on this node (LOCAL_WORLD_SIZE) see {facts.visible_devices} "
            f"GPU(s): LOCAL_RANK % {facts.visible_devices} puts rank {facts.local_rank} on a GPU another rank "
            f"uses too (NCCL then fails with 'Duplicate GPU'); run one rank per GPU (torchrun "
            f"--nproc-per-node {facts.visible_devices}) or give each rank its own CUDA_VISIBLE_DEVICES"
        )
    index, current = facts.device.index, facts.current_index
    if facts.nccl and index is not None and current is not None and index != current:
        problems.append(
            f"this rank loads onto {facts.device} but its current CUDA device is cuda:{current}; "
            f"call torch.cuda.set_device({index}) before init_process_group"
        )
    return problems


def setup_problems(device: torch.device, mesh, fp8_linears: int) -> list[str]:
    """What would make the first collective hang or land on the wrong device: the mesh; the
    GPU's capability, two ranks on one GPU, the device passed vs the current one."""
    problems = []
    if mesh is not None:
        world = rank_and_world()[1]
        problems += [f"mesh: {p}" for p in mesh_problems(mesh, device.type, world)]
    return problems + device_problems(device_facts(device, fp8_linears))
