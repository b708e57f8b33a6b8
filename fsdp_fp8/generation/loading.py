"""From run settings to a ready engine: which checkpoint (the given one, or the embedded demo),
the settings every rank must share agreed before the mesh is built, ``load_pipeline`` with the settings' layout, backend and guardrail, then the ``Engine``.

The launcher and the server call the same function; the Python API calls ``load_pipeline`` and
``Engine`` itself with the same values.
"""

from __future__ import annotations

import dataclasses
import logging

from fsdp_fp8.collective import agree_on_settings, rank_and_world
from fsdp_fp8.compose.pipeline import load_pipeline
from fsdp_fp8.format.hub import checkpoint_identity, resolve_hub_path
from fsdp_fp8.generation.engine import Engine
from fsdp_fp8.generation.values import RUN_SETTINGS_TO_AGREE, GenerationRequest, RunSettings
from fsdp_fp8.interop.diffusers_pipeline import is_pipeline_index, schedule_of

log = logging.getLogger("fsdp_fp8")


def is_pipeline_root(path) -> bool:
    """Whether ``path`` (a directory or a hub name in the local cache) holds ``model_index.json``
    (or a modular pipeline's ``modular_model_index.json``)."""
    try:
        return is_pipeline_index(resolve_hub_path(path))
    except FileNotFoundError:  # not in the cache: load_model says so, in its own words
        return False


def checkpoint_of(settings: RunSettings, request: GenerationRequest) -> tuple[object, GenerationRequest]:
    """``settings.checkpoint``, else the embedded demo (built once, then cached) with the request's
    unset sizes taken from the demo's."""
    if settings.checkpoint:
        return settings.checkpoint, request
    from fsdp_fp8.generation.demo import demo_checkpoint

    if rank_and_world()[0] == 0:
        log.info("using the embedded demo checkpoint (built once, then cached)")
    return demo_checkpoint(), demo_sizes(request)


def with_schedule(path, request: GenerationRequest, given) -> GenerationRequest:
    """``request`` on a distilled root (``path``): its step count and guidance 1.0 where the
    command line gave none (one given off the schedule was refused before: ``generation.inputs``)."""
    steps = schedule_of(resolve_hub_path(path)) if is_pipeline_root(path) else None
    if steps is None:
        return request
    return dataclasses.replace(
        request,
        steps=request.steps if "steps" in given else steps,
        guidance=request.guidance if "guidance" in given else 1.0,
    )


def demo_sizes(request: GenerationRequest) -> GenerationRequest:
    """``request`` with its unset sizes the demo's: one image, or its shortest video when
    conditioned or with sound."""
    from fsdp_fp8.generation.demo import DEMO_CONDITIONED_FRAMES, DEMO_SIZE

    sizes = dict(DEMO_SIZE)
    if request.image or request.video or request.sound:
        sizes["num_frames"] = DEMO_CONDITIONED_FRAMES
    return request.with_default_sizes(sizes)


def agree_on_run_settings(settings: RunSettings, path, step_policy: str = "auto") -> None:
    """Every rank given the same run settings (``collective.settings``), agreed before the mesh is
    built: the checkpoint (its resolved directory), the layout, the attention backend, the decode,
    residency, the step policy, the guardrail and the timeout. A difference is one ``ArgumentError``
    on every rank naming each setting and which ranks hold which value. Nothing without a process
    group of several ranks."""
    agreed = {
        "checkpoint": checkpoint_identity(path),
        **{name: getattr(settings, name) for name in RUN_SETTINGS_TO_AGREE},
        "step_policy": step_policy,
    }
    agree_on_settings(agreed, timeout_s=settings.timeout, context="cannot start the run")


def load_engine(path, settings: RunSettings, *, step_policy: str = "auto", mesh=None, options=None, given=()) -> Engine:
    """``load_pipeline(path)`` as ``settings`` ask (over ``mesh``, the launcher's ``ParallelMesh``;
    or, in one process, the settings' degrees), then its ``Engine``. ``given``: the options set
    explicitly (diffusers' default attention backend unless one was)."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()  # "Loading pipeline components..." on every rank
    layout = mesh.layout if mesh is not None else None
    work = {} if layout is not None else {"cfg_parallel": settings.cfg_parallel, "ulysses": settings.ulysses}
    pipe = load_pipeline(
        path,
        mesh,
        step_policy=step_policy,
        # diffusers' own default (native) unless the option was given: its setter warns of an
        # experimental feature, which a default run has not asked for
        attention_backend=settings.attention_backend if "attention_backend" in given else None,
        cache=settings.cache,
        options=options,
        **work,
        **({"enable_safety_checker": False, "safety_checker": None} if settings.safety_check == "off" else {}),
    )
    return Engine(pipe, settings)


__all__ = [
    "RUN_SETTINGS_TO_AGREE",
    "agree_on_run_settings",
    "checkpoint_of",
    "demo_sizes",
    "is_pipeline_root",
    "load_engine",
    "with_schedule",
]
