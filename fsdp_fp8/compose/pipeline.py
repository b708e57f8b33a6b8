"""``load_pipeline``: a diffusers pipeline whose transformer fsdp_fp8 loaded, sharded, with its step policy.

One function, top to bottom: ``agree_on_settings`` (the same checkpoint, layout, backend, policy
and timeout on every rank), the checks of ``model_index.json``, the class and the layout,
``build_mesh``, ``load_model`` over the mesh's weight dims, ``prepare_for_inference``, the
pipeline's own ``from_pretrained`` (a modular pipeline: its blocks), then the transformer's
per-forward state and the pipeline's request gate.

Every other component is loaded by diffusers from local files only (``local_files_only=True``,
``trust_remote_code=False``): nothing is downloaded, no checkpoint code runs, no ModelOpt needed.

Design: docs/design.md, "The two pipelines"; usage: docs/interop.md, "The pipeline".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_fp8.collective import agree_on_settings, distributed, rank_and_world
from fsdp_fp8.collective.attached import Attachment
from fsdp_fp8.compose.model import load_model
from fsdp_fp8.errors import ArgumentError, LayoutError
from fsdp_fp8.format.hub import checkpoint_identity, resolve_hub_path
from fsdp_fp8.format.remote_code import safe_pretrained_kwargs
from fsdp_fp8.interop import cfg_parallel as cfg_facts
from fsdp_fp8.interop import ulysses as ulysses_facts
from fsdp_fp8.interop.attention_backend import backend_problems, use_backend
from fsdp_fp8.interop.cfg_parallel import CfgPair
from fsdp_fp8.interop.diffusers_pipeline import (
    TRANSFORMER,
    distilled_steps,
    guardrail_problem,
    index_path,
    is_modular,
    missing_components,
    pipeline_class,
    read_model_index,
)
from fsdp_fp8.interop.forward_state import PipelineState, attach_pipeline_state
from fsdp_fp8.interop.modular import blocks_of, blocks_problems, load_modular
from fsdp_fp8.interop.request_agreement import RequestGate, attach_request_gate, library_class, request_teams
from fsdp_fp8.interop.step_cache import StepCache, Voters, cache_config, cache_problems
from fsdp_fp8.interop.ulysses import Ulysses, install_ulysses
from fsdp_fp8.load.loaded import LoadedModel
from fsdp_fp8.load.options import SETTINGS, LoadOptions, load_options
from fsdp_fp8.load.spec import TowerSpec
from fsdp_fp8.runtime.inference import prepare_for_inference
from fsdp_fp8.runtime.parallel_layout import AttentionHeads, ParallelLayout
from fsdp_fp8.runtime.parallel_mesh import ParallelMesh, build_mesh
from fsdp_fp8.third_party import quiet_imports, quiet_warnings

# A pipeline's transformer's LoadedModel, kept by ``load_pipeline``; read by ``loaded_of``
# (docs/design.md, "State kept on other libraries' objects").
LOADED: Attachment[LoadedModel] = Attachment("the LoadedModel of a pipeline's transformer")
# The layout a pipeline was loaded for and its mesh (None in one process); read by ``work_of``.
WORK: Attachment[tuple[ParallelLayout, ParallelMesh | None]] = Attachment("the layout and mesh of a pipeline")


def load_pipeline(
    path: str | os.PathLike,
    mesh: DeviceMesh | ParallelMesh | None = None,
    *,
    step_policy: str | dict = "auto",
    towers: TowerSpec | None = None,
    cfg_parallel: bool = False,
    ulysses: int | None = None,
    sequence_parallel: int | None = None,
    attention_backend: str | None = None,
    cache=None,
    options: LoadOptions | None = None,
    **kwargs,
):
    """The diffusers pipeline at ``path`` (a directory with ``model_index.json`` or ``modular_model_index.json``,
    or a hub name resolved through the local cache only), its transformer loaded by fsdp_fp8 and sharded over
    ``mesh`` (a ``DeviceMesh`` for the weights; default: every rank), or over the weight dims of a
    ``ParallelMesh`` (``fsdp_fp8.build_mesh``), whose layout then gives the work dims too.

    ``step_policy``: ``"auto"`` (the checkpoint's), ``"off"`` (every step W8A8) or a policy dict. ``towers``
    overrides the tower map. ``options`` (``LoadOptions``) and keyword arguments named like its fields (``device``,
    ``read_options``, ``timeout_s``, ...) go to ``load_model``; every other keyword argument goes to the pipeline's
    ``from_pretrained`` (e.g. ``safety_checker=None``); a ``transformer``, ``trust_remote_code`` or
    ``custom_pipeline`` is refused, and ``local_files_only`` is always set. Collective under a process group, like
    ``load_model``, its ranks given the same settings (else one ``ArgumentError`` on every rank).
    ``fsdp_fp8.loaded_of(pipe)`` is the ``LoadedModel`` and ``fsdp_fp8.routing_of(pipe.transformer)`` the routing
    (its ``trace``: one precision per step run; ``summary()``: ``"W8A16 x3 / W8A8 x14 / W8A16 x3"``);
    ``fsdp_fp8.loaded_of(pipe).close()`` lets the transformer go at once (its storage freed; the others are diffusers').

    ``cfg_parallel``: ranks in pairs run the two guidance passes of each step at once
    (``fsdp_fp8.interop.cfg_parallel``). ``ulysses`` (``sequence_parallel``: the same, its older
    name): groups of that many ranks split the generation tokens of each pass by Ulysses attention
    (``fsdp_fp8.interop.ulysses``; Cosmos 3). The ranks of one request (``runtime.parallel_layout``)
    must then be given the same request; the world size must divide into them, and the degree into
    the attention heads (all checked, with what diffusers must still provide, before anything loads:
    one ``LayoutError`` / ``ArgumentError``); every call of the pipeline then first agrees on its
    request among them (``fsdp_fp8.interop.request_agreement``: a difference is one error on every
    rank).

    ``attention_backend``: one of diffusers' attention backend names (``"native"``, ``"flex"``,
    ``"flash"``, ...; ``interop.attention_backend``) for every attention layer, the CFG and
    Ulysses paths included; one that is not installed or cannot run on the device is refused
    before the load, naming those that can. ``None``: diffusers' default. ``cache``: ``None`` / ``"off"``
    (default), ``"seacache[:THRESHOLD]"`` or a diffusers ``SeaCacheConfig`` (``interop.step_cache``).
    """
    settings = {name: kwargs.pop(name) for name in list(kwargs) if name in SETTINGS}
    given = mesh.layout if isinstance(mesh, ParallelMesh) else None
    layout_args = _work_degrees(given, cfg_parallel, ulysses, sequence_parallel)
    options = load_options(options, mesh=mesh.weights if isinstance(mesh, ParallelMesh) else mesh, **settings)
    root = resolve_hub_path(path)  # a directory, or a hub name through the local cache only
    cache = _agree_on_settings(root, given, layout_args, attention_backend, step_policy, options, cache)  # before reads
    index = read_model_index(root)
    with quiet_imports():
        cls = pipeline_class(index["_class_name"], index_path(root))
    components = _components(kwargs)  # refuses a transformer, trust_remote_code / custom_pipeline
    blocks = blocks_of(cls, index, index_path(root)) if is_modular(cls) else None  # our step end in its loops
    layout = _layout(root, cls, index, given, blocks, *layout_args)  # alike on every rank: their settings agreed
    _refuse_before_load(root, index, components, attention_backend, options.device, cache, blocks)
    mesh, options = _with_mesh(layout, mesh, options)
    loaded = load_model(None, root / TRANSFORMER, towers=towers, options=options)
    if attention_backend is not None:  # before the Ulysses processors, which take the backend over
        use_backend(loaded.model, attention_backend)
    routing = prepare_for_inference(loaded, step_policy)
    pipe = _pipeline_of(cls, root, blocks, loaded.model, components)
    _components_to(pipe, options.device)
    _attach_work(pipe, routing, layout, mesh, options.timeout_s, cache)
    LOADED.set(pipe, loaded)
    return pipe


def _components(kwargs: dict) -> dict:
    """The keywords for the pipeline's ``from_pretrained``: no ``transformer`` (ours), no remote code."""
    if TRANSFORMER in kwargs:
        raise ArgumentError("load_pipeline loads the `transformer` itself; do not pass one")
    return safe_pretrained_kwargs(**kwargs)


def _components_to(pipe, device) -> None:
    """Every component but the transformer (loaded on its device already) moved to ``device``."""
    for component in (c for n, c in pipe.components.items() if n != TRANSFORMER and isinstance(c, nn.Module)):
        component.to(device)


def _pipeline_of(cls: type, root: Path, blocks, transformer, components: dict):
    """Every other component read by diffusers from ``root``: ``from_pretrained``, or a modular
    pipeline's ``blocks`` and ``load_components`` (``interop.modular``)."""
    with quiet_imports(import_time_only=False), quiet_warnings():  # what never concerns a user (third_party)
        if blocks is not None:
            return load_modular(cls, root, blocks, transformer, components)
        return cls.from_pretrained(str(root), transformer=transformer, **components)


def _agree_on_settings(root: Path, given, layout_args, attention_backend, step_policy, options, cache):
    """Before anything is read: every rank given the same checkpoint (``format.hub.checkpoint_identity``),
    layout, attention backend, step policy, timeout and step cache (the device is each rank's own); a
    difference is one ``ArgumentError`` on every rank naming the setting and which ranks hold which
    value. Returns the step cache as diffusers' ``SeaCacheConfig`` (None: off)."""
    cfg_parallel, ulysses = layout_args
    settings = {
        "checkpoint": checkpoint_identity(root),
        "cfg_parallel": cfg_parallel,
        "ulysses": ulysses,
        "replicas": given.replicas if given is not None else 1,
        "attention_backend": attention_backend,
        "step_policy": step_policy,
        "timeout_s": options.timeout_s,
        "cache": cache if cache is None or isinstance(cache, str) else repr(cache),  # parsed once agreed
    }
    agree_on_settings(settings, timeout_s=options.timeout_s, context="load_pipeline")
    return _cache_config(cache)  # alike on every rank: a bad value is the same error on each


def _cache_config(cache):
    """``cache`` as diffusers' ``SeaCacheConfig`` (None: off); a bad one is an ``ArgumentError``."""
    try:
        return cache_config(cache)
    except ArgumentError as exc:
        raise ArgumentError(exc.problems, "load_pipeline") from None


def _with_mesh(layout: ParallelLayout, mesh, options: LoadOptions):
    """The one mesh of ``layout`` (built here unless a ``ParallelMesh`` was given) and the options
    whose weights it shards, unless they name their own mesh."""
    if isinstance(mesh, ParallelMesh) or not dist.is_initialized():
        return mesh, options
    mesh = build_mesh(layout, options.device.type)
    return mesh, options if options.mesh is not None else options.replace(mesh=mesh.weights)


def _attach_work(pipe, routing, layout: ParallelLayout, mesh, timeout_s: float, cache) -> None:
    """The transformer's per-forward state (step routing, the CFG pair on ``mesh["cfg"]``, the
    Ulysses group on ``mesh["ulysses"]``, the step cache voting over the world) and the pipeline's
    request gate: each call one request, its ranks meeting before its first forward (compared when
    a request spans several ranks)."""
    team = layout.cfg * layout.ulysses
    teams = request_teams(layout.world, team, timeout_s) if distributed() else None
    gate = RequestGate(teams, compares=team > 1)
    state = PipelineState(routing, gate=gate)
    if cache is not None:
        world = mesh.world.get_group() if isinstance(mesh, ParallelMesh) else dist.group.WORLD
        voters = Voters.of(layout, world, dist.get_rank()) if dist.is_initialized() else None
        state.cache = StepCache(cache, voters)
    if layout.ulysses > 1:
        state.ulysses = Ulysses.of(mesh)
        install_ulysses(pipe.transformer, state.ulysses)
    if layout.cfg_parallel:
        state.cfg = CfgPair.of(mesh)
    attach_pipeline_state(pipe.transformer, state)
    attach_request_gate(pipe, gate)
    WORK.set(pipe, (layout, mesh if isinstance(mesh, ParallelMesh) else None))


def _refuse_before_load(root: Path, index: dict, components: dict, attention_backend, device, cache, blocks) -> None:
    """What would fail after the load, refused before it: a component folder ``model_index.json``
    names that is missing, a guardrail the pipeline builds whose package is missing (not a
    traceback from diffusers), an attention backend that cannot run, a step cache on a transformer
    without Cosmos 3's decoder stack or a diffusers without SeaCache, a modular pipeline's
    ``blocks`` that no longer take what fsdp_fp8 passes them."""
    problems = missing_components(root, index, components)
    if cache is not None:
        problems += [f"cache: {p}" for p in cache_problems(index[TRANSFORMER][1])]
    if blocks is not None:
        problems += blocks_problems(blocks, index_path(root))
    if guardrail := guardrail_problem(index, components):
        problems.append(f"{root}: {guardrail}; or load it without: enable_safety_checker=False, safety_checker=None")
    if attention_backend is not None:
        problems += backend_problems(attention_backend, device)
    if problems:
        raise ArgumentError(problems, "load_pipeline")


def _work_degrees(given: ParallelLayout | None, cfg_parallel, ulysses, sequence_parallel) -> tuple[bool, int]:
    """(cfg_parallel, the Ulysses degree) from the keywords, ``sequence_parallel`` the older name of
    ``ulysses``; a ``ParallelMesh``'s layout when one was given (the keywords may only repeat it)."""
    problems = []
    if ulysses is not None and sequence_parallel is not None and ulysses != sequence_parallel:
        problems.append(f"ulysses={ulysses!r} and sequence_parallel={sequence_parallel!r} name one degree; give one")
    degree = ulysses if ulysses is not None else sequence_parallel
    if given is not None:
        if degree not in (None, given.ulysses) or cfg_parallel not in (False, given.cfg_parallel):
            problems.append(
                f"the ParallelMesh given is {given.describe()}; cfg_parallel={cfg_parallel!r} / "
                f"ulysses={degree!r} differ from it (leave them out)"
            )
        cfg_parallel, degree = given.cfg_parallel, given.ulysses
    if problems:
        raise ArgumentError(problems, "load_pipeline")
    return cfg_parallel, 1 if degree is None else degree


def _layout(
    root: Path, cls: type, index: dict, given: ParallelLayout | None, blocks, cfg_parallel: bool, ulysses: int
) -> ParallelLayout:
    """The layout, checked once with the transformer's heads and what diffusers must provide for
    CFG-parallel and Ulysses (from the files, the classes, a modular pipeline's ``blocks`` and the
    world size alone). A distilled root (``distilled_sigmas``) runs guidance 1.0: one pass per
    step, no CFG pair to split."""
    if cfg_parallel is True and (steps := distilled_steps(index)) is not None:
        raise LayoutError(
            f"{index_path(root)}: a distilled checkpoint ({steps}-step `distilled_sigmas`) runs guidance 1.0, one "
            "transformer pass per step: there is no CFG pair to split (cfg_parallel / --cfg-parallel); use "
            "ulysses / replicas instead",
            "load_pipeline",
        )
    source = root / TRANSFORMER / "config.json"
    split = isinstance(ulysses, int) and not isinstance(ulysses, bool) and ulysses > 1  # else refused below
    heads = AttentionHeads.of(json.loads(source.read_text()), str(source)) if split else None
    world = given.world if given is not None else rank_and_world()[1]
    replicas = given.replicas if given is not None else 1
    layout = ParallelLayout(world, cfg_parallel=cfg_parallel, ulysses=ulysses, replicas=replicas, heads=heads)
    problems = []
    if cfg_parallel is True:
        import diffusers

        name = index[TRANSFORMER][1]
        transformer_cls = getattr(diffusers, name, None)
        if not isinstance(transformer_cls, type):
            problems.append(f"{index_path(root)}: `{TRANSFORMER}` {name!r} is not a model class of diffusers")
        else:
            problems += cfg_facts.diffusers_problems(cls, transformer_cls, blocks)
    if split:
        problems += ulysses_facts.diffusers_problems()
    if problems:
        raise LayoutError(problems, "diffusers changed what fsdp_fp8's parallel layout relies on")
    return layout


def pipeline_name(pipe) -> str:
    """The name of the pipeline's diffusers class (under fsdp_fp8's subclass, when it has one)."""
    return library_class(pipe).__name__


def work_of(pipe) -> tuple[ParallelLayout, ParallelMesh | None]:
    """The layout ``pipe`` (from ``load_pipeline``) was loaded for, and its mesh (None without a
    process group, or when the caller gave a plain ``DeviceMesh`` for the weights)."""
    work = WORK.get(pipe)
    if work is None:
        raise ArgumentError(f"this {type(pipe).__name__} was not loaded by fsdp_fp8.load_pipeline")
    return work


def loaded_of(pipe) -> LoadedModel:
    """The ``LoadedModel`` of ``pipe``'s transformer (``pipe`` from ``load_pipeline``): the
    checkpoint, the load plan and report, the FP8 linears, the tower map."""
    loaded = LOADED.get(pipe)
    if loaded is None:
        raise ArgumentError(f"this {type(pipe).__name__} was not loaded by fsdp_fp8.load_pipeline")
    return loaded
