"""``load_model``: the one-call path from a checkpoint directory to a loaded, sharded model.

It composes the layers below in the order they run: join the ranks -> plan alone (open, the
class ``config.json`` names, build on meta and plan, the tower map) -> ``load_planned``
(``fsdp_fp8.load.api``: agree, start prefetch, one collective phase). The class and the
tower map live here and in ``runtime``, above the load path, which sees only a ``model_fn``
and the problems they add to the ``PlannedLoad``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_fp8.collective import DEFAULT_TIMEOUT_S
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.format.read_options import DEFAULT_READ_OPTIONS, ReadOptions
from fsdp_fp8.format.step_policy import parse_step_policy
from fsdp_fp8.interop.architectures import known_towers, resolve_architecture
from fsdp_fp8.load.api import LoadedModel, PlannedLoad, default_device, join_ranks, load_planned, plan_on_meta
from fsdp_fp8.runtime.towers import TOWERS_HINT, TowerSpec, needs_towers, resolve_towers, tower_problems


def load_model(
    model_fn: Callable[[dict], nn.Module] | None,
    path: str | os.PathLike,
    mesh: DeviceMesh | None = None,
    key_map: Callable[[str], str | None] | None = None,
    *,
    device: torch.device | None = None,
    strict: bool = True,
    strict_kv_scales: bool = False,
    towers: TowerSpec | None = None,
    agreement_timeout_s: float = DEFAULT_TIMEOUT_S,
    read_options: ReadOptions = DEFAULT_READ_OPTIONS,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int = True,
) -> LoadedModel:
    """Build ``model_fn(config_dict)`` on meta and load the checkpoint at ``path`` into it.

    ``model_fn=None`` builds the class the checkpoint's ``config.json`` names (our reference
    model, or a transformers / diffusers class with ``fsdp_fp8[hf]``; see
    ``fsdp_fp8.interop.architectures``). ``strict_kv_scales`` refuses FP8 KV-cache scales the model
    has no place for instead of warning (``fsdp_fp8.load.plan``).

    With a process group up, this is collective: the model is ``fully_shard``-ed over
    ``mesh`` (default: a 1-D mesh over every rank) and each rank loads only its rows. A 2-D
    ``(replicate, shard)`` mesh (``fsdp_wrap.device_mesh(device_type, replicas)``) is HSDP: rows
    are split over the shard dim and every replica group reads the checkpoint once. A mesh that
    is not 1-D or 2-D, not over every rank of the default group, or on another device type is
    refused on every rank before anything is sharded. Without a process group, it
    loads a plain single-process model. ``towers`` maps linear names to towers for the step
    policy (``fsdp_fp8.runtime.towers``); without it the class's own map is used (our reference
    MoT, diffusers ``Cosmos3OmniTransformer``), and a checkpoint whose step policy runs the
    towers differently is refused for a class that has none. Every rank raises the same error
    if any rank finds a problem, or if the ranks read different configs, index, headers or
    scales, or built different models or plans, before anything is swapped, sharded or read.

    ``agreement_timeout_s``: how long a rank waits for its peers in the agreement before
    loading; the agreement after the reads adds the time the slowest rank's forecast bytes
    take at ``collective.ASSUMED_READ_BYTES_PER_S``. A later peer is named in a
    ``PeerLostError``. The agreements run on a gloo side group (docs/reliability.md).
    ``read_options``: threads, request size, staging and prefetch budgets of this load's reads.
    ``mp_policy``, ``offload_policy``, ``reshard_after_forward``: passed to ``fully_shard``
    (``fsdp_wrap.shard_model``). Under ``CPUOffloadPolicy`` the model is materialized in host
    memory and each rank reads its rows straight into its host shards (no device copy during
    the load); buffers, which FSDP2 does not manage, go to ``device``.

    The steps, in the order they run::

        join ranks -> plan (every rank alone) -> agree -> start prefetch ->
        collective_phase: swap, shard, materialize, stop prefetch, read rows
    """
    join_ranks(path, agreement_timeout_s)  # collective: before any rank can fail or die
    device = device or default_device()
    planned = plan_model_load(
        model_fn, path, key_map, device=device, strict=strict, strict_kv_scales=strict_kv_scales, towers=towers
    )
    return load_planned(
        planned,
        path,
        mesh,
        device=device,
        agreement_timeout_s=agreement_timeout_s,
        read_options=read_options,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
    )


def plan_model_load(
    model_fn: Callable[[dict], nn.Module] | None,
    path: str | os.PathLike,
    key_map: Callable[[str], str | None] | None = None,
    *,
    device: torch.device,
    strict: bool = True,
    strict_kv_scales: bool = False,
    towers: TowerSpec | None = None,
) -> PlannedLoad:
    """Open, resolve the architecture, build on meta, plan and check the tower map, exactly as
    ``load_model`` does on each rank, collecting every problem instead of raising. Touches no
    process group and reads no tensor data beyond the scales: ``python -m fsdp_fp8 verify``
    runs this."""
    planned = PlannedLoad()
    try:
        checkpoint = planned.checkpoint = open_checkpoint(path)
        if model_fn is None:
            source = f"{checkpoint.directory}/config.json"
            planned.architecture = resolve_architecture(checkpoint.config, source, checkpoint)
            model_fn = planned.architecture.model_fn
        plan_on_meta(planned, model_fn, key_map, device=device, strict=strict, strict_kv_scales=strict_kv_scales)
        planned.towers, problems = _tower_map(towers, planned)
        planned.problems += problems
    except Exception as exc:  # any failure here must reach every rank, not strand them in a collective
        planned.refuse(exc)
    return planned


def _tower_map(spec: TowerSpec | None, planned: PlannedLoad) -> tuple[dict[str, str] | None, list[str]]:
    """The tower map (the user's, else the class's), and what is wrong with it for this
    checkpoint: a step policy that runs the towers differently needs one (fail-closed)."""
    arch, model, checkpoint = planned.architecture, planned.model, planned.checkpoint
    if spec is None:
        spec = arch.towers if arch is not None else known_towers(model)
    towers = resolve_towers(spec, model)
    raw = checkpoint.quant.step_policy
    source = f"{checkpoint.directory}/config.json"
    if towers is None:
        if raw is not None and needs_towers(parse_step_policy(raw, source)):
            return None, [
                f"{source}: the step policy's `reasoner` ({raw.get('reasoner')!r}) differs from its steps, but "
                f"{arch.name if arch else type(model).__name__} has no known tower map, so fsdp_fp8 cannot tell "
                f"the reasoner's linears from the generation tower's; {TOWERS_HINT}"
            ]
        return None, []
    return towers, tower_problems(towers, [t.module for t in planned.plan.fp8], "the tower map")
