"""``load_model``: a checkpoint directory to a loaded, sharded model, composed top to bottom.

Each step takes values and returns a value; nothing below calls back up here: ``load_options``,
``join_ranks``, then ``agreement_before_changes`` around ``plan_model`` (open, the ``ModelSpec``,
meta build, plan, towers, device checks) and ``choose_rank_reads``, then ``start_prefetch``, then
one ``collective_phase("load")``: swap, ``fully_shard``, ``to_empty``, read the rank's rows.

``load/`` holds the steps and takes resolved values (a ``ModelSpec``, a ``LoadOptions``); it never
imports ``interop``, which only resolves specs.

Design: docs/design.md, "The two pipelines".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_fp8.collective import agreement_before_changes, collective_phase, mark_unusable, outcome_timeout_s
from fsdp_fp8.errors import CheckpointError, raise_if_problems
from fsdp_fp8.format.checkpoint import Checkpoint, open_checkpoint
from fsdp_fp8.format.facts import checkpoint_facts
from fsdp_fp8.format.step_policy import parse_step_policy
from fsdp_fp8.fp8.linear import cuda_shape_problems
from fsdp_fp8.interop.architectures import model_spec
from fsdp_fp8.load.fsdp_wrap import model_facts, planned_position, shard_as
from fsdp_fp8.load.loaded import LoadedModel
from fsdp_fp8.load.meta_build import buffers_to, build_on_meta, materialize
from fsdp_fp8.load.options import LoadOptions, load_options
from fsdp_fp8.load.plan import LoadPlan, plan_load, warn_not_strict
from fsdp_fp8.load.preflight import join_ranks, setup_problems
from fsdp_fp8.load.reader import load_report, read_rows
from fsdp_fp8.load.spec import ModelSpec, TowerSpec
from fsdp_fp8.load.swap import swap_fp8_linears
from fsdp_fp8.reading.prefetch import start_prefetch
from fsdp_fp8.reading.read_choice import ReadChoice, choose_reads
from fsdp_fp8.runtime.towers import resolve_towers, tower_map_problems

ModelFn = Callable[[dict], nn.Module]
KeyMap = Callable[[str], "str | None"]


def load_model(
    model_fn: ModelFn | None,
    path: str | os.PathLike,
    mesh: DeviceMesh | None = None,
    key_map: KeyMap | None = None,
    *,
    towers: TowerSpec | None = None,
    options: LoadOptions | None = None,
    **settings,
) -> LoadedModel:
    """Build ``model_fn(config_dict)`` on meta and load the checkpoint at ``path`` into it.

    ``model_fn=None`` builds the class the checkpoint's ``config.json`` names (our reference MoT,
    or a transformers / diffusers class with ``fsdp_fp8[hf]``). ``towers`` maps linear names to
    towers for the step policy (``fsdp_fp8.runtime.towers``; default: the class's own map).
    ``options`` (``LoadOptions``) holds every setting of the load; keyword ``settings`` are its
    fields (``device``, ``strict``, ``timeout_s``, ``read_options``, ``mp_policy``, ...) applied on
    top, and ``mesh`` is its ``mesh``. See ``fsdp_fp8.load.options.LoadOptions``.

    With a process group up, this is collective: the model is ``fully_shard``-ed over the mesh
    (default: every rank) and each rank reads only its rows. Every rank raises the same error
    if any rank finds a problem, or if the ranks read different files or built different models
    or plans, before anything is swapped, sharded or read; a failure during the load raises the
    same ``LoadFailedError`` on every rank and leaves the model unusable.
    """
    options = load_options(options, mesh=mesh, **settings)
    join_ranks(f"cannot load {path}", options.timeout_s)  # collective: before any rank can fail or die
    with agreement_before_changes(f"cannot load {path}", options.timeout_s) as pending:
        planned = plan_model(model_fn, path, key_map, towers=towers, options=options)
        pending.on_refusal(planned.release)
        reads = choose_rank_reads(planned.plan, options, f"cannot load {path}")
        pending.facts = planned.facts(options)
    model, plan, checkpoint = planned.model, planned.plan, planned.checkpoint
    warn_not_strict(plan)
    shards, shard = planned_position(options.mesh)  # the rows this rank will hold once sharded
    prefetch = start_prefetch(plan, shards, shard, reads.prefetch_bytes)
    wait_s = outcome_timeout_s(plan.slowest_rank_bytes(shards), options.timeout_s)
    try:
        with collective_phase(model, "load", wait_s, failed="checkpoint load failed"):
            swapped = swap_fp8_linears(model, plan, options.kernels)
            shard_as(model, options)
            materialize(model, options.storage_device)  # keeps non-persistent buffers and tied weights
            buffers_to(model, options.device)
            prefetched = prefetch.stop()
            t0 = time.perf_counter()
            rows = read_rows(model, plan, reads.options)
    except BaseException:
        prefetch.stop()
        checkpoint.close()  # the model is dead: its descriptors go too
        raise
    report = load_report(rows, plan, time.perf_counter() - t0, prefetched, reads.why, reads.options)
    model.eval()
    return LoadedModel(model, checkpoint, plan, report, swapped, planned.spec, planned.towers)


def choose_rank_reads(plan: LoadPlan, options: LoadOptions, context: str) -> ReadChoice:
    """How this rank reads its rows (``reading.read_choice``), before any read; a forced
    ``O_DIRECT`` a file refuses raises here, inside the agreement, so every rank raises it."""
    shards, shard = planned_position(options.mesh)
    ranges = [(e.handle, offset, n) for e, offset, n in plan.rank_ranges(shards, shard) if n]
    handles = list({id(h): h for h, _, _ in ranges}.values())
    choice, problems = choose_reads(options.read_options, handles, ranges)
    raise_if_problems(problems, context)
    return choice


@dataclass(frozen=True, eq=False)
class PlannedModel:
    """What one rank decided before the ranks agree: nothing is changed or read yet but the scales."""

    checkpoint: Checkpoint
    spec: ModelSpec
    model: nn.Module  # on meta
    plan: LoadPlan
    towers: dict[str, str] | None  # the tower map, checked against the plan

    def facts(self, options: LoadOptions) -> dict[str, dict[str, str]]:
        """What the ranks must have read and built alike (compared by digest in the agreement)."""
        return {
            **checkpoint_facts(self.checkpoint),
            "load plan": self.plan.facts(),
            **model_facts(self.model, options.device.type, options.mesh),
        }

    def release(self, error: BaseException) -> None:
        """Refused: the model must not run, and the files are closed."""
        mark_unusable(self.model, str(error))
        self.checkpoint.close()


def plan_model(
    model_fn: ModelFn | None,
    path: str | os.PathLike,
    key_map: KeyMap | None = None,
    *,
    towers: TowerSpec | None = None,
    options: LoadOptions,
) -> PlannedModel:
    """Every step ``load_model`` takes on each rank alone before the ranks agree: open, the
    ``ModelSpec``, build on meta, plan, the tower map and the device checks. Raises
    ``CheckpointError`` listing every problem (a built model is then marked unusable and the files
    closed). Touches no process group and reads no tensor data beyond the scales (``verify``)."""
    checkpoint = open_checkpoint(path)
    model = None
    try:
        spec = model_spec(model_fn, checkpoint, towers)  # interop: the class config.json names
        model = build_on_meta(spec.model_fn, checkpoint.config)
        problems = setup_problems(options.device, options.mesh, len(checkpoint.fp8_modules))
        try:
            plan = plan_load(
                checkpoint, model, key_map=key_map, strict=options.strict, strict_kv_scales=options.strict_kv_scales
            )
        except CheckpointError as exc:  # with the device problems below: every problem at once
            raise_if_problems(exc.problems + problems, exc.context)
        tower_map = resolve_towers(spec.towers, model)
        problems += _tower_problems(tower_map, plan, checkpoint, spec, model)
        if options.device.type == "cuda":
            problems += cuda_shape_problems(plan.fp8)
        raise_if_problems(problems, f"cannot load {path}")
    except BaseException as exc:
        if model is not None:
            mark_unusable(model, str(exc))
        checkpoint.close()
        raise
    return PlannedModel(checkpoint, spec, model, plan, tower_map)


def _tower_problems(tower_map, plan: LoadPlan, checkpoint: Checkpoint, spec: ModelSpec, model) -> list[str]:
    source = f"{checkpoint.directory}/config.json"
    raw = checkpoint.quant.step_policy
    policy = parse_step_policy(raw, source) if raw is not None else None
    name = type(model).__name__ if spec.kind == "custom" else spec.name
    return tower_map_problems(tower_map, [t.module for t in plan.fp8], policy, name, source)
