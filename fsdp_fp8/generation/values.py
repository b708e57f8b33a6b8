"""What to generate and how to run it, as frozen values: each option of the launcher is one
field here, declared once (``generation.declare.option``), from which the command line, the
bounds, the "used by" table, ``--help`` and the option table of docs/usage.md are all made.

- ``GenerationRequest``: what one run generates (the prompt or prompts file, sampling, sizes,
  conditioning). The server makes one per HTTP request from the fields marked ``per_request``.
- ``RunSettings``: how the pipeline is loaded and run (checkpoint, layout, memory, decode).
- ``Prompt``: one request of a run (``--prompt``, or a line of ``--prompts``).

Adding an option that is a pipeline keyword is one field here and its use (``generation.engine``).
A field's ``type`` is a callable, or the name of one of the command line's text parsers
(``cli.arguments.TEXT_PARSERS``: lists of integers, byte counts).
No torch here: the launcher parses and checks its options before torch loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_fp8.format.cache_option import cache_option_problems
from fsdp_fp8.format.timeouts import MAX_TIMEOUT_S, timeout_problems
from fsdp_fp8.generation.actions import ACTION_MODES, RESOLUTION_TIERS
from fsdp_fp8.generation.declare import EVERY, option

COMPILE_MODES = ("off", "regional")


def compile_problems(mode: object) -> list[str]:
    """``--compile regional`` is refused before the load, with its reason (issue 48)."""
    if mode != "regional":
        return []
    return [
        "--compile regional is not supported yet: diffusers' compile_repeated_blocks finds the blocks by class "
        "name (`Cosmos3VLTextMoTDecoderLayer`) and FSDP2's fully_shard renames each sharded block's class "
        "(`FSDPCosmos3VLTextMoTDecoderLayer`), so diffusers finds none and raises; compiling the FP8 blocks "
        "under FSDP2's hooks ourselves is not yet shown to give the eager bits. Run without --compile"
    ]


DEFAULT_PROMPT = "a red fox jumps over a sleeping dog, golden hour"
DEFAULT_LATENT_TOKENS = 64
RESIDENT_POLICIES = ("none", "auto", "all")  # fsdp_fp8.runtime.residency.POLICIES (a test holds them equal)
VAE_TILING = ("auto", "on", "off")  # runtime.vae_forecast.MODES, kept here to parse without torch
QUANTIZE_METHODS = ("fp8", "mxfp8", "nvfp4")  # fsdp_fp8.runtime.ptq.METHODS (likewise)
# diffusers' attention backend registry (interop.attention_backend.backend_names; a test holds them equal)
ATTENTION_BACKENDS = (
    "flash", "flash_hub", "flash_varlen", "flash_varlen_hub", "flash_4_hub", "_flash_3", "_flash_varlen_3",
    "_flash_3_hub", "_flash_3_varlen_hub", "aiter_fa2_hub", "flex", "native", "_native_cudnn", "_native_efficient",
    "_native_flash", "_native_math", "_native_npu", "_native_xla", "sage", "sage_hub", "sage_blackwell_hub",
    "sage_varlen", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton", "xformers",
)  # fmt: skip

# The kinds of run (``cli.runner``): a diffusers pipeline root, a Cosmos 3 denoiser alone, the
# reference MoT, a transformers causal LM, any other diffusers or transformers model.
PIPELINE, COSMOS3, MOT, CAUSAL_LM, DIFFUSERS = "pipeline", "cosmos3", "mot", "causal_lm", "diffusers"
DIFFUSION = (PIPELINE, COSMOS3, MOT)

# The --help groups, in the order --help shows them.
WHAT, PIPELINES, CONDITIONING, LM, SHARDING, QUANTIZING, REPORTING = (
    "what to run",
    "diffusers pipelines",
    "conditioning (diffusers pipelines; read by diffusers' load_image / load_video)",
    "causal language models",
    "sharding and memory",
    "quantizing a high-precision checkpoint at load (one process)",
    "reporting",
)
GROUPS = (WHAT, PIPELINES, CONDITIONING, LM, SHARDING, QUANTIZING, REPORTING)


def frame_index_problems(indexes) -> list[str]:
    """Why ``indexes`` (``--condition-frames``) are no latent frame indexes: none, or one below 0
    (the timeline's end is the pipeline's: ``generation.inputs``)."""
    shown = ",".join(str(i) for i in indexes)
    if not indexes:
        return ["--condition-frames lists no latent frame index; give one or more, e.g. 0,1"]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in indexes):
        return [f"--condition-frames takes latent frame indexes (integers such as 0,1), got {tuple(indexes)!r}"]
    if min(indexes) < 0:
        return [f"--condition-frames {shown}: a latent frame index is >= 0, got {min(indexes)}"]
    return []


@dataclass(frozen=True)
class Prompt:
    """One request of a run: ``--prompt`` (with ``--image`` / ``--video``), or one line of
    ``--prompts`` (a plain line: its text; a JSON line: its own fields, ``None`` where it takes
    the command line's). ``line``: where in the file (0: the command line)."""

    text: str
    negative_prompt: str | None = None
    image: str | None = None
    video: str | None = None
    seed: int | None = None
    line: int = 0

    def mode(self, frames: int | None, sound: bool = False) -> str:
        """The kind of job in words, as the report names it: ``image-to-video, 9 frames, sound``."""
        source = "image" if self.image else "video" if self.video else "text"
        if frames == 1 and source == "text" and not sound:
            return "text-to-image"
        return f"{source}-to-video" + (f", {frames} frames" if frames else "") + (", sound" if sound else "")


@dataclass(frozen=True)
class GenerationRequest:
    """What one run generates: the prompt(s), the sampling and the sizes (``None``: the demo's,
    else the pipeline's)."""

    prompt: str = option(
        DEFAULT_PROMPT,
        "prompt text (a pipeline's tokenizer, else its bytes become token ids)",
        WHAT,
        (*DIFFUSION, CAUSAL_LM),
        per_request=True,
    )
    steps: int = option(
        20,
        "denoising steps (default 20; a distilled root: its fixed schedule's)",
        WHAT,
        DIFFUSION,
        bound=(1, 10_000),
        type=int,
        per_request=True,
    )
    seed: int = option(0, "noise seed (default 0)", WHAT, (*DIFFUSION, DIFFUSERS), type=int, per_request=True)
    guidance: float = option(
        3.0,
        "classifier-free guidance scale (default 3.0; a distilled root: 1.0, its only one)",
        WHAT,
        DIFFUSION,
        type=float,
        per_request=True,
    )
    step_policy: str = option(
        "auto",
        "auto: the checkpoint's diffusion step policy; off: every step W8A8",
        WHAT,
        DIFFUSION,
        choices=("auto", "off"),
    )
    latent_tokens: int = option(
        DEFAULT_LATENT_TOKENS,
        "reference MoT: latent tokens (default 64)",
        WHAT,
        MOT,
        bound=(1, 1_000_000),
        type=int,
    )
    prompts: str | None = option(
        None,
        'one request per line (UTF-8, blank lines skipped): a prompt, or a JSON object with "prompt" and '
        'optionally "negative_prompt", "image", "video", "seed"; request group g of G (G = WORLD_SIZE '
        "without --cfg-parallel / --ulysses, else WORLD_SIZE over the ranks of one request) generates requests "
        "g, g + G, g + 2G, ...",
        PIPELINES,
        PIPELINE,
        metavar="FILE",
    )
    negative_prompt: str | None = option(
        None,
        "the unconditional prompt (default empty)",
        PIPELINES,
        (PIPELINE, COSMOS3),
        per_request=True,
    )
    output: str | None = option(
        None,
        "save the decoded result as .png (an image, or an animated PNG of the frames) or .mp4; with "
        "--prompts: FILE-000.png, FILE-001.png, ...",
        PIPELINES,
        PIPELINE,
        metavar="FILE",
    )
    frames: int | None = option(
        None,
        "frames to generate (1: an image; default: the demo's, else the pipeline's)",
        PIPELINES,
        PIPELINE,
        bound=(1, 1024),
        type=int,
        per_request=True,
    )
    height: int | None = option(
        None,
        "height in pixels (default: the demo's, else the pipeline's)",
        PIPELINES,
        PIPELINE,
        bound=(1, 16_384),
        type=int,
        per_request=True,
    )
    width: int | None = option(
        None,
        "width in pixels (default: the demo's, else the pipeline's)",
        PIPELINES,
        PIPELINE,
        bound=(1, 16_384),
        type=int,
        per_request=True,
    )
    fps: float = option(
        24.0,
        "frames per second: the prompt template and the mp4 (default 24)",
        PIPELINES,
        PIPELINE,
        bound=(0.0, 1000.0, True),
        type=float,
        per_request=True,
    )
    flow_shift: float | None = option(
        None,
        "the scheduler's flow shift for this run (its config's `flow_shift`, set through the scheduler's "
        "from_config; default: the pipeline's own)",
        PIPELINES,
        PIPELINE,
        bound=(0.0, 100.0, True),
        type=float,
        per_request=True,
    )
    image: str | None = option(
        None,
        "image-to-video: condition the first frame on this PNG, JPEG or WebP image (at most 8192 x 8192 "
        "pixels; needs --frames above 1)",
        CONDITIONING,
        PIPELINE,
        metavar="PATH",
        per_request=True,
    )
    video: str | None = option(
        None,
        "video-to-video: continue this clip (an mp4, an animated GIF or PNG, or a directory of frames; at "
        "most 1024 frames)",
        CONDITIONING,
        PIPELINE,
        metavar="PATH",
        per_request=True,
    )
    condition_frames: tuple[int, ...] | None = option(
        None,
        "with --video: the latent frames kept clean, each >= 0 and inside the latent timeline (1 + (--frames - 1) / "
        "the VAE's `scale_factor_temporal` latent frames; default: the pipeline's, 0,1)",
        CONDITIONING,
        PIPELINE,
        type="frame_indexes",
        metavar="I,J",
        per_request=True,
        check=frame_index_problems,
    )
    condition_keep: str | None = option(
        None,
        "with --video: take the conditioning frames from its first or its last frames (default: the pipeline's, first)",
        CONDITIONING,
        PIPELINE,
        choices=("first", "last"),
        per_request=True,
    )
    sound: bool = option(
        False,
        "generate an audio track with the video, muxed into the .mp4 --output (diffusers' encode_video, "
        "PyAV); needs a pipeline with a sound tokenizer",
        CONDITIONING,
        PIPELINE,
        action="store_true",
        per_request=True,
    )
    # --- action jobs (Cosmos 3 world models; generation.actions): one contiguous block
    action: str | None = option(
        None,
        "an action job (a transformer with `action_gen`): forward_dynamics rolls --image forward under --actions; "
        "policy rolls it out and predicts the actions; inverse_dynamics infers the actions of a --video",
        CONDITIONING,
        PIPELINE,
        per_request=True,
        choices=ACTION_MODES,
    )
    domain: str | None = option(
        None,
        "with --action: the embodiment, one of diffusers' action domains (e.g. pusht, umi, droid_lerobot)",
        CONDITIONING,
        PIPELINE,
        per_request=True,
        metavar="NAME",
    )
    chunk_size: int | None = option(
        None,
        "with --action: the action steps of the chunk (the video is 1 + that many frames)",
        CONDITIONING,
        PIPELINE,
        per_request=True,
        bound=(1, 1024),
        type=int,
    )
    resolution_tier: int | None = option(
        None,
        "with --action: the conditioning canvas tier (default: diffusers', 480)",
        CONDITIONING,
        PIPELINE,
        per_request=True,
        type=int,
        choices=RESOLUTION_TIERS,
    )
    actions: str | None = option(
        None,
        "with --action forward_dynamics: the raw actions [T, D], a .npy, .json or .csv file",
        CONDITIONING,
        PIPELINE,
        per_request=True,
        metavar="FILE",
    )
    # --- end of action jobs
    prompt_ids: tuple[int, ...] | None = option(
        None,
        "the prompt as token ids, e.g. 1,2,3",
        LM,
        CAUSAL_LM,
        type="token_ids",
    )
    new_tokens: int = option(8, "greedy tokens to generate (default 8)", LM, CAUSAL_LM, bound=(1, 100_000), type=int)

    def sizes(self) -> dict:
        """The pipeline's size keywords that are set (``num_frames``, ``height``, ``width``)."""
        named = (("num_frames", self.frames), ("height", self.height), ("width", self.width))
        return {key: value for key, value in named if value is not None}

    def with_default_sizes(self, sizes: dict) -> GenerationRequest:
        """The request with each unset size taken from ``sizes`` (pipeline keyword names)."""
        fields = {"frames": "num_frames", "height": "height", "width": "width"}
        chosen = {name: sizes[key] for name, key in fields.items() if getattr(self, name) is None and key in sizes}
        return dataclasses.replace(self, **chosen)


@dataclass(frozen=True)
class RunSettings:
    """How the launcher loads and runs: the checkpoint, the ranks' layout, memory, quantization
    and the report."""

    checkpoint: str | None = option(
        None,
        "ModelOpt static-FP8 checkpoint directory, pipeline root or hub repo id (default: the embedded demo)",
        WHAT,
        EVERY,
    )
    nproc_per_node: int | None = option(
        None,
        "start N ranks on this machine and report their outcome quietly: what torchrun --standalone does, "
        "without its failure report",
        WHAT,
        EVERY,
        bound=(1, 1024),
        type=int,
        metavar="N",
    )
    attention_backend: str = option(
        "native",
        "diffusers' attention backend for the transformer (default native: torch SDPA); one whose kernel "
        "is missing or cannot run on this device is refused before the load, naming those that can",
        PIPELINES,
        PIPELINE,
        choices=ATTENTION_BACKENDS,
        metavar="NAME",
    )
    safety_check: str = option(
        "on",
        "on (default): the pipeline's own guardrail runs where its model_index.json turns it on (Cosmos: the "
        "cosmos_guardrail package; missing, the run is refused before the load); off: loaded and run without it",
        PIPELINES,
        PIPELINE,
        choices=("on", "off"),
    )
    vae_tiling: str = option(
        "auto",
        "the VAE decode: on: diffusers' tiled decode, its tiles split over the ranks of a request (the "
        "frames of one rank's tiled decode, byte for byte); auto: tiled where the untiled decode's forecast "
        "exceeds the free device memory; off: the pipeline's own decode on the writing rank (default auto)",
        PIPELINES,
        PIPELINE,
        choices=VAE_TILING,
    )
    compile: str = option(
        "off",
        "regional: torch.compile of the transformer's repeated blocks (diffusers' compile_repeated_blocks); "
        "refused before the load for now, naming why; off (default)",
        PIPELINES,
        PIPELINE,
        choices=COMPILE_MODES,
        check=compile_problems,
    )
    cache: str = option(
        "off",
        "step caching (Cosmos 3): seacache[:THRESHOLD] skips the transformer's decoder stack on steps whose "
        "latents changed little since the last computed step and reuses its extrapolated residual (diffusers' "
        "SeaCache, threshold 0.25 unless given; higher reuses more): fewer passes, an output that differs from "
        "the uncached one, the same at any layout; off (default)",
        PIPELINES,
        PIPELINE,
        check=cache_option_problems,
        metavar="off|seacache[:THRESHOLD]",
    )
    replicas: int = option(
        1,
        "HSDP: shard within each of R replica groups of WORLD_SIZE / R consecutive ranks (one node each, with "
        "torchrun's rank order) and replicate across them (default 1: shard over every rank)",
        SHARDING,
        EVERY,
        type=int,
        metavar="R",
    )
    resident: str = option(
        "none",
        "FSDP2 blocks kept gathered between forwards: none (re-gather each forward), auto (what "
        "--resident-budget and the free device memory allow), all",
        SHARDING,
        EVERY,
        choices=RESIDENT_POLICIES,
    )
    resident_budget: int | None = option(
        None,
        "with --resident auto: the most the gathered blocks may take per rank (e.g. 60e9, 48GiB)",
        SHARDING,
        EVERY,
        type="byte_count",
        metavar="BYTES",
    )
    timeout: float = option(
        600.0,
        f"seconds before a stuck collective fails (default 600; at most {MAX_TIMEOUT_S:,.0f})",
        SHARDING,
        EVERY,
        type=float,
        check=timeout_problems,
    )
    ulysses: int = option(
        1,
        "pipeline (Cosmos 3): Ulysses groups of N ranks split the generation tokens of each pass "
        "(--sequence-parallel: its older name); N must divide the query heads and divide the key/value heads or "
        "be a multiple of them, and the ranks of a request (N, 2N with --cfg-parallel) must divide the world "
        "size (default 1)",
        SHARDING,
        PIPELINE,
        flags=("--ulysses", "--sequence-parallel"),
        type=int,
        metavar="N",
    )
    cfg_parallel: bool = option(
        False,
        "pipeline: ranks in pairs run the conditional and the unconditional pass of each step at once "
        "(needs an even world)",
        SHARDING,
        PIPELINE,
        action="store_true",
    )
    quantize: str | None = option(
        None,
        "quantize the linears with TorchAO at load",
        QUANTIZING,
        EVERY,
        choices=QUANTIZE_METHODS,
    )
    include: tuple[str, ...] = option(
        (),
        "only linears whose name matches RE (re.search; repeatable)",
        QUANTIZING,
        EVERY,
        action="append",
        metavar="RE",
    )
    exclude: tuple[str, ...] = option(
        (),
        "leave linears whose name matches RE in high precision (repeatable)",
        QUANTIZING,
        EVERY,
        action="append",
        metavar="RE",
    )
    report: str | None = option(
        None,
        "also write the report as JSON (rank 0); its directory is created if missing",
        REPORTING,
        EVERY,
        metavar="PATH",
    )
    overwrite: bool = option(
        False,
        "replace output files (--output, --report) that already exist (default: refuse them before loading)",
        REPORTING,
        EVERY,
        action="store_true",
    )


@dataclass(frozen=True)
class Job:
    """One launcher run: the request, the settings, and the options given on the command line."""

    request: GenerationRequest
    settings: RunSettings
    given: frozenset[str] = frozenset()


VALUE_CLASSES = (GenerationRequest, RunSettings)

# What every rank must be given alike, besides the checkpoint and the step policy
RUN_SETTINGS_TO_AGREE = (
    "cfg_parallel",
    "ulysses",
    "replicas",
    "attention_backend",
    "vae_tiling",
    "cache",
    "resident",
    "resident_budget",
    "safety_check",
    "timeout",
)


@dataclass(frozen=True)
class OptionValues:
    """A request and the settings read as one set of options: what the checks take (every option
    an attribute, as on the command line)."""

    request: GenerationRequest
    settings: RunSettings

    def __getattr__(self, name: str):
        for part in (self.request, self.settings):
            if name in _NAMES[type(part)]:
                return getattr(part, name)
        raise AttributeError(name)


_NAMES = {cls: {f.name for f in dataclasses.fields(cls)} for cls in VALUE_CLASSES}


def value_fields() -> dict[str, str]:
    """Every option ``dest`` the values hold -> the value class holding it."""
    return {f.name: cls.__name__ for cls in VALUE_CLASSES for f in dataclasses.fields(cls)}


__all__ = [
    "ATTENTION_BACKENDS",
    "GROUPS",
    "GenerationRequest",
    "Job",
    "OptionValues",
    "RUN_SETTINGS_TO_AGREE",
    "Prompt",
    "RunSettings",
    "VALUE_CLASSES",
    "value_fields",
]
