"""diffusers' modular pipelines (``Cosmos3DistilledModularPipeline``, ``Cosmos3OmniModularPipeline``):
built from their blocks with one block of ours, and called in ``Cosmos3OmniPipeline``'s terms.

A modular pipeline has no ``__call__`` of its own arguments and no step callback: it runs blocks
over a state. fsdp_fp8 needs a step's end to meet the request's peers (``generation.meetings``),
so the pipeline is built from its blocks (diffusers' ``ModularPipeline(blocks=..., pretrained_model_name_or_path=...)``,
the class the root's index names, the blocks it names or the class's default) with one
``StepEnd`` block appended to each denoising loop: it calls the state's ``callback_on_step_end``
after the scheduler's step, as ``Cosmos3OmniPipeline`` does, and stops the loop when the callback
sets ``pipe._interrupt`` (raising ``LoopStopped``; ``call_modular`` turns it into no output).

Nothing else of diffusers changes: the transformer is ours (``update_components``), every other
component diffusers' own ``load_components`` reads from the root, local files only.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format.remote_code import SAFE_PRETRAINED_KWARGS
from fsdp_fp8.interop.diffusers_pipeline import TRANSFORMER

STEP_END = "fsdp_fp8_step_end"  # the name of our block in each denoising loop
CALLBACK = "callback_on_step_end"


class LoopStopped(Exception):
    """The step callback asked the loop to stop (``pipe._interrupt``): nothing is returned."""


# diffusers logs every exception a block raises, with its traceback, at each level of blocks
DIFFUSERS_BLOCKS_LOGGER = "diffusers.modular_pipelines.modular_pipeline"


class _StopsUnlogged(logging.Filter):
    """Drops the records diffusers logs while it handles our ``LoopStopped`` (a stop is no error);
    every other record, and every other exception's, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not isinstance(sys.exc_info()[1], LoopStopped)


@contextlib.contextmanager
def _stops_unlogged():
    """``_StopsUnlogged`` on diffusers' blocks logger for one call, removed after it."""
    logger, quiet = logging.getLogger(DIFFUSERS_BLOCKS_LOGGER), _StopsUnlogged()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _step_end_class():
    from diffusers.modular_pipelines import ModularPipelineBlocks
    from diffusers.modular_pipelines.modular_pipeline_utils import InputParam

    class StepEnd(ModularPipelineBlocks):
        """Calls ``callback_on_step_end(pipe, i, t, {})`` after each denoising step."""

        @property
        def description(self) -> str:
            return "fsdp_fp8: calls the step callback after each denoising step (its peers meet there)"

        @property
        def inputs(self):
            return [InputParam(name=CALLBACK, default=None, description="called after each step")]

        def __call__(self, components, block_state, i, t):
            callback = getattr(block_state, CALLBACK, None)
            if callback is not None:
                callback(components, i, t, {})
                if getattr(components, "_interrupt", False):
                    raise LoopStopped(f"stopped after step {i + 1}")
            return components, block_state

    return StepEnd


def denoising_loops(blocks) -> list:
    """Every ``LoopSequentialPipelineBlocks`` under ``blocks`` (diffusers' denoising loops), found by type."""
    from diffusers.modular_pipelines import LoopSequentialPipelineBlocks

    found = []
    for block in (blocks.sub_blocks or {}).values():
        found += [block] if isinstance(block, LoopSequentialPipelineBlocks) else denoising_loops(block)
    return found


def blocks_of(cls: type, index: dict, source: Path):
    """The blocks the index names (``_blocks_class_name``, one of diffusers' own) or the class's
    default, each denoising loop ending in our ``StepEnd``."""
    import diffusers
    from diffusers.modular_pipelines import ModularPipelineBlocks

    name = index.get("_blocks_class_name") or cls.default_blocks_name
    blocks_cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(blocks_cls, type) and issubclass(blocks_cls, ModularPipelineBlocks)):
        raise ArgumentError(f"{source}: `_blocks_class_name` {name!r} is not pipeline blocks of diffusers")
    blocks = blocks_cls()
    loops = denoising_loops(blocks)
    if not loops:
        raise ArgumentError(f"{source}: the blocks {name} have no denoising loop (fsdp_fp8 meets at its steps)")
    for loop in loops:
        loop.sub_blocks.insert(STEP_END, _step_end_class()(), len(loop.sub_blocks))
        loop.set_progress_bar_config(disable=True)  # the launcher logs each step itself
    return blocks


# The inputs ``call_modular`` hands the blocks (the engine's request in diffusers' names); every
# one must be an input of the blocks, else diffusers would warn and drop it
CALL_INPUTS = (
    "prompt",
    "image",
    "video",
    "condition_frame_indexes_vision",
    "condition_video_keep",
    "num_frames",
    "height",
    "width",
    "fps",
    "num_inference_steps",
    "guidance_scale",
    "generator",
    "output_type",
    "mixed_precision_format",
    CALLBACK,
)


def blocks_problems(blocks, source: Path) -> list[str]:
    """What of ``CALL_INPUTS`` the blocks (``blocks_of``) no longer take, named (diffusers changed)."""
    taken = {param.name for param in blocks.inputs}
    return [
        f"{source}: diffusers' {type(blocks).__name__} no longer take `{name}`, which fsdp_fp8 passes"
        for name in CALL_INPUTS
        if name not in taken
    ]


def load_modular(cls: type, root: Path, blocks, transformer, components: dict):
    """``cls`` at ``root`` over ``blocks`` (``blocks_of``), every component but the transformer read
    by diffusers from ``root`` (local files only, no checkpoint code), ``transformer`` ours.
    ``components``: ``from_pretrained``-style keywords (a component given, ``enable_safety_checker``)."""
    given = {k: v for k, v in components.items() if k not in SAFE_PRETRAINED_KWARGS}  # set below, always
    safety = given.pop("enable_safety_checker", None)
    pipe = cls(blocks=blocks, pretrained_model_name_or_path=str(root), local_files_only=True)
    names = [n for n in pipe.null_component_names if n != TRANSFORMER and n not in given]
    pipe.load_components(names=names, pretrained_model_name_or_path=str(root), **SAFE_PRETRAINED_KWARGS)
    missing = [n for n in names if getattr(pipe, n, None) is None]
    if missing:  # diffusers only warns when a component fails to load
        raise ArgumentError(
            f"{root}: diffusers could not load the components {', '.join(missing)} (its warnings say why)"
        )
    pipe.update_components(**{TRANSFORMER: transformer}, **{k: v for k, v in given.items() if v is not None})
    if safety is False or given.get("safety_checker", 0) is None or not pipe.config.enable_safety_checker:
        pipe.disable_safety_checker()
    else:
        pipe.enable_safety_checker(given.get("safety_checker"))
    return pipe


@dataclass(frozen=True)
class ModularOutput:
    """What ``Cosmos3OmniPipeline`` returns with ``output_type="latent"``: ``video`` the latents
    (None when the loop was stopped), ``sound`` the waveform, ``action`` the predicted actions
    (a list of one tensor; None where the blocks made none: the distilled blocks make neither)."""

    video: object | None
    sound: object | None = None
    action: list | None = None


# The keywords only some blocks take (``Cosmos3OmniBlocks``: all three; ``Cosmos3DistilledBlocks``:
# none): passed to blocks that take them, refused by the others
OPTIONAL_INPUTS = {"negative_prompt": None, "enable_sound": False, "action": None}


def call_modular(pipe, prompt: str, *, output_type="latent", **kwargs):
    """``pipe`` (a modular pipeline from ``load_modular``) called with ``Cosmos3OmniPipeline``'s
    keywords: the prompt, sizes, conditioning, ``num_inference_steps``, ``guidance_scale``,
    ``generator``, ``callback_on_step_end``, and where its blocks take them the negative prompt,
    ``enable_sound`` and an ``action``; the latents (``output_type="latent"``), the sound and the
    predicted actions back."""
    taken = {param.name for param in pipe.blocks.inputs}
    refused = [k for k, unset in OPTIONAL_INPUTS.items() if kwargs.get(k, unset) != unset and k not in taken]
    if refused:
        raise ArgumentError(
            f"{type(pipe).__name__}'s blocks ({type(pipe.blocks).__name__}) take no {', '.join(refused)} (a distilled "
            "checkpoint's guidance is baked into its weights: no negative prompt; it makes no sound and no actions)"
        )
    kwargs = {k: v for k, v in kwargs.items() if k not in OPTIONAL_INPUTS or v != OPTIONAL_INPUTS[k]}
    if output_type != "latent":
        raise ArgumentError(f"call_modular returns latents (output_type='latent'), not {output_type!r}")
    pipe._interrupt = False  # as Cosmos3OmniPipeline's own call begins: a stop ends one request only
    # diffusers' own step policy stays off: fsdp_fp8's routing sets each step's precision
    try:
        with _stops_unlogged():
            out = pipe(
                prompt=prompt,
                output_type="latent",
                output=["videos", "sound", "action"],
                mixed_precision_format="none",
                **kwargs,
            )
    except LoopStopped:
        return ModularOutput(None)
    return ModularOutput(out["videos"], out.get("sound"), out.get("action"))


__all__ = [
    "CALL_INPUTS",
    "LoopStopped",
    "ModularOutput",
    "OPTIONAL_INPUTS",
    "blocks_of",
    "blocks_problems",
    "call_modular",
    "denoising_loops",
    "load_modular",
]
