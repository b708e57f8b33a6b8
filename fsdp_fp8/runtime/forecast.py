"""Per-GPU peak memory of a Cosmos 3 denoising run, forecast from configs and headers alone.

The peak is a sum of named terms, each from what the loader and FSDP2 hold at the moment the
largest decoder layer runs its MLP on the generation tokens (the largest working set):

- ``sharded weights``: this rank's rows of every tensor, padded to ``ceil(rows / world)``
  (``fsdp_fp8.shard_rows``); FP8 codes one byte each. ``--offload cpu`` puts them in host
  memory and copies the shards of the units in flight to the device instead.
- ``root unit, gathered``: FSDP2 never reshards the root (embeddings, heads, ``proj_in/out``)
  after its first forward; it stays whole on every rank.
- ``decoder layers in flight``: the running layer, gathered, and with forward prefetch the next
  one's all-gather buffer (FSDP2 issues it before the running layer computes).
- ``resident layers``: layers kept gathered between forwards (``--resident all``).
- ``non-FP8 components``: every other component folder's safetensors (VAE, safety checker);
  the text tokenizer holds no tensors.
- ``activations``: the Cosmos 3 transformer at ``text + vision (+ action)`` tokens (vision tokens
  from the frame count, the VAE's compression and the patch size; an action job's ``chunk_size``
  action tokens beside its ``1 + chunk_size`` frames, fitted into its resolution tier's canvas as
  diffusers fits them, ``action_video_size``): the layer inputs and residuals of
  both towers, the generation MLP's three ``tokens x intermediate`` products and its FP8
  input, the attention's Q/K/V, rotary temporaries, the concatenated K/V and the outputs.
  Attention itself is counted as flash attention's working set (linear in the tokens, no
  ``tokens^2`` matrix), which is what SDPA runs on these unmasked calls on CUDA and on CPU.
- ``latents and scheduler``: the float32 latents, their 16-bit copy, both guidance
  predictions and the multistep solver's history.
- ``CFG-parallel exchange``: the pair's all-gather buffers (two predictions).

Not forecast here: the VAE's phases (they run after the transformer's activations are freed;
``runtime.vae_forecast`` forecasts them beside this loop's resident terms), the CUDA context and NCCL's buffers
(about 0.5-1 GiB per GPU; add them), allocator fragmentation.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.errors import ArgumentError, CheckpointError, raise_if_problems
from fsdp_fp8.format.pipeline_config import positive_int_problem, read_pipeline_factors
from fsdp_fp8.runtime.parallel_layout import ParallelLayout, ulysses_rows
from fsdp_fp8.shard_rows import padded_rows

GiB = 1 << 30
# The pipeline's default text prefix (system prompt, chat template and a prompt): a planning
# figure, overridable; a longer prompt adds (tokens x hidden x 2) bytes per live sequence.
DEFAULT_TEXT_TOKENS = 512
SOLVER_HISTORY = 2  # UniPC (solver_order 2) keeps this many past model outputs
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class Tensor:
    key: str
    shape: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class Term:
    name: str
    device_bytes: int
    host_bytes: int = 0
    detail: str = ""


@dataclass(frozen=True)
class TransformerShape:
    """What the activations depend on, from the transformer's ``config.json``."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    latent_channels: int
    patch: int
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> TransformerShape:
        """The shape from a ``Cosmos3OmniTransformer`` config; every field must be an integer
        >= 1 (the forecast multiplies and divides by them), else one ``CheckpointError`` naming
        ``where``, each key and its value."""
        problems = [f"{where}: `{key}` is missing" for key in _SHAPE_KEYS.values() if key not in config]
        problems += [
            p for key in _SHAPE_KEYS.values() if key in config if (p := positive_int_problem(config, key, where))
        ]
        raise_if_problems(problems, f"cannot forecast from {where}")
        return cls(**{field: config[key] for field, key in _SHAPE_KEYS.items()})


# TransformerShape's fields, from the config keys of diffusers' Cosmos3OmniTransformer
_SHAPE_KEYS = {
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "layers": "num_hidden_layers",
    "latent_channels": "latent_channel",
    "patch": "latent_patch_size",
}


@dataclass(frozen=True)
class VideoSize:
    height: int
    width: int
    frames: int
    spatial: int = 16  # the VAE's compression (vae/config.json: scale_factor_spatial)
    temporal: int = 4  # (scale_factor_temporal)

    def latent(self) -> tuple[int, int, int]:
        return (self.frames - 1) // self.temporal + 1, -(-self.height // self.spatial), -(-self.width // self.spatial)

    def vision_tokens(self, patch: int) -> int:
        f, h, w = self.latent()
        return f * -(-h // patch) * -(-w // patch)


@dataclass(frozen=True)
class ActionChunk:
    """An action job's part of the sequence (diffusers' ``CosmosActionCondition``): ``chunk_size``
    action tokens in the generation pathway beside ``1 + chunk_size`` frames, those fitted into the
    canvas of ``resolution_tier`` (diffusers' default 480)."""

    mode: str
    chunk_size: int
    resolution_tier: int = 480


def action_video_size(height: int, width: int, action: ActionChunk, spatial: int, temporal: int) -> VideoSize:
    """The video an action job of a ``height`` x ``width`` first frame denoises, as diffusers'
    ``_prepare_action_video_conditioning`` makes it: the frames read at a multiple of the VAE's
    ``spatial`` factor, fitted (never upscaled) into the tier's canvas of the closest aspect ratio,
    the latent then cropped to that content (``_remove_action_video_padding_from_latent``: whole
    latent pixels, at least one)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _ACTION_RESOLUTION_BINS
    from diffusers.video_processor import VideoProcessor

    source_h, source_w = height - height % spatial, width - width % spatial
    if not (source_h and source_w):
        raise ArgumentError(
            f"an action job's frames are read at multiples of {spatial} pixels (the VAE's `scale_factor_spatial`): "
            f"{height} x {width} has none"
        )
    bins = _ACTION_RESOLUTION_BINS[str(action.resolution_tier)]
    target_h, target_w = VideoProcessor.classify_height_width_bin(source_h, source_w, ratios=bins)
    scale = min(target_w / source_w, target_h / source_h, 1.0)
    content_h, content_w = (max(1, int(scale * n + 0.5)) for n in (source_h, source_w))
    latent_h, latent_w = max(content_h // spatial, 1), max(content_w // spatial, 1)
    return VideoSize(latent_h * spatial, latent_w * spatial, action.chunk_size + 1, spatial, temporal)


def mode_words(frames: int, action: ActionChunk | None = None, schedule: int | None = None) -> str:
    """The request a forecast is for, as the run's report names it: ``policy, 9 frames, 8 actions``,
    ``an image, distilled, 4 steps``."""
    if action is not None:
        words = f"{action.mode}, {frames} frames, {action.chunk_size} actions"
    else:
        words = "an image" if frames == 1 else f"{frames} frames"
    return words + (f", distilled, {schedule} steps" if schedule is not None else "")


@dataclass(frozen=True)
class MemoryForecast:
    world_size: int
    text_tokens: int
    vision_tokens: int
    terms: tuple[Term, ...]
    action_tokens: int = 0
    mode: str = ""  # mode_words
    video: VideoSize | None = None  # the video denoised (an action job's: fitted to its tier)

    @property
    def device_bytes(self) -> int:
        return sum(t.device_bytes for t in self.terms)

    @property
    def host_bytes(self) -> int:
        return sum(t.host_bytes for t in self.terms)

    def lines(self) -> list[str]:
        host = any(t.host_bytes for t in self.terms)
        mode = f" ({self.mode})" if self.mode else ""
        actions = f" + {self.action_tokens} action" if self.action_tokens else ""
        out = [
            f"memory forecast per GPU, world size {self.world_size}{mode}: {self.text_tokens} text + "
            f"{self.vision_tokens} vision{actions} tokens"
        ]
        for t in self.terms:
            row = f"  {t.name:<28} {_gib(t.device_bytes):>10}"
            if host:
                row += f"  host {_gib(t.host_bytes):>10}"
            out.append(row + (f"  ({t.detail})" if t.detail else ""))
        total = f"  {'peak (sum)':<28} {_gib(self.device_bytes):>10}"
        if host:
            total += f"  host {_gib(self.host_bytes):>10}"
        out.append(total)
        out.append(
            "  not included: the VAE (its phases follow for a pipeline root), CUDA context and NCCL buffers (~0.5-1 GiB), fragmentation"
        )
        return out


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 100 else f"{n / (1 << 20):.2f} MiB"


def _nbytes(t: Tensor) -> int:
    return math.prod(t.shape) * t.itemsize


def _shard_bytes(t: Tensor, world: int) -> int:
    if not t.shape:
        return t.itemsize  # 0-d scales: replicated
    return padded_rows(t.shape[0], world) * math.prod(t.shape[1:]) * t.itemsize


def units(tensors: Iterable[Tensor], fp32_modules: Iterable[str] = ("time_embedder",)) -> dict[str, list[Tensor]]:
    """The FSDP units ``fsdp_fp8.load.fsdp_wrap.shard_model`` makes of a Cosmos 3 transformer:
    one per decoder layer (``layers.N``), one per float32 module, the root for the rest."""
    fp32 = tuple(f"{m}." for m in fp32_modules)
    out: dict[str, list[Tensor]] = {}
    for t in tensors:
        m = _LAYER.match(t.key)
        name = f"layers.{m.group(1)}" if m else next((p[:-1] for p in fp32 if t.key.startswith(p)), "root")
        out.setdefault(name, []).append(t)
    return out


def activation_terms(
    shape: TransformerShape,
    text: int,
    vision: int,
    cfg_parallel: bool,
    fp8_time_embedder: bool = False,
    ulysses: int = 1,
    action_tokens: int = 0,
) -> list[Term]:
    """The transformer's working set at its widest moment, phase by phase (no autograd: a
    temporary dies when its expression is done). A W8A8 linear quantizes its input through two
    float32 temporaries (``clamp(x.float() / s)``, ``fsdp_fp8.fp8.kernels``): 8 bytes per input
    element while it runs, then 1 byte of FP8 codes.

    With a Ulysses group of ``ulysses`` ranks the decoder stack runs on this rank's
    generation rows (``rows``: ``parallel_layout.ulysses_rows``) beside the whole text; the packed
    sequence, its rotary tables and the time embedding stay whole (built before the split), and
    the attention adds the all-to-alls' buffers (``ulysses_terms``). An action job's
    ``action_tokens`` run in the generation pathway beside the vision tokens (split alike); their
    latents (``chunk_size x action_dim``) are left out of the latents' term, a few KiB."""
    generation = vision + action_tokens
    tokens = text + generation
    sp = ulysses
    rows = generation if sp == 1 else ulysses_rows(generation, sp)
    phases = _activation_phases(shape, text, generation, rows, fp8_time_embedder, sp)
    e = shape.dtype_bytes
    rope = 4 * tokens * shape.head_dim * e  # cos / sin of both pathways, held through the stack
    positions = 3 * tokens * 8 + tokens * 8 * 2  # mRoPE ids and the sequence indexes (int64)
    widest = max(phases, key=phases.get)
    terms = [
        Term(
            "activations",
            phases[widest] + rope + positions,
            detail=f"{tokens} tokens{f', {rows} generation rows on this rank' if sp > 1 else ''}; "
            f"widest: {widest} {_gib(phases[widest])} (then "
            + ", ".join(f"{k} {_gib(v)}" for k, v in phases.items() if k != widest)
            + ")",
        )
    ]
    latent = vision * shape.patch**2 * shape.latent_channels
    terms.append(
        Term(
            "latents and scheduler",
            latent * (4 * (3 + SOLVER_HISTORY) + e),
            detail="float32 latents, both predictions, solver history",
        )
    )
    if cfg_parallel:
        terms.append(Term("CFG-parallel exchange", 3 * latent * e, detail="all-gather of both predictions, one held"))
    return terms


def _activation_phases(
    shape: TransformerShape, text: int, vision: int, rows: int, fp8_time_embedder: bool, sp: int
) -> dict[str, int]:
    """Bytes live at the widest moment of each phase of one forward (``activation_terms``)."""
    e, h, inter = shape.dtype_bytes, shape.hidden, shape.intermediate
    tokens = text + vision
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    local = text + rows  # the rows a decoder layer of this rank runs
    quant = 8  # float32 temporaries of one activation quantization, per element
    # Time embedding of every vision token (Timesteps(256) -> TimestepEmbedding in float32),
    # beside the packed sequence and proj_in's output.
    freq = 256
    linear_2 = vision * h * (4 + (quant if fp8_time_embedder else 0) + 4)
    # get_timestep_embedding: the scaled angles (freq / 2), their sin and cos, and the
    # concatenation (freq), all float32, live at once: 2.5 x freq x 4 bytes per token.
    time = tokens * h * e + vision * h * e + max(vision * freq * 10, vision * (freq + h) * 4, linear_2)
    # Attention: layer inputs, normed inputs and their FP8 codes, Q/K/V, the float32 RMSNorm of
    # Q (two temporaries), the rotary temporaries of Q, K/V concatenated for the generation
    # pathway, the outputs and to_out's input quantization (flash attention: O(tokens), no
    # tokens^2 matrix; SDPA runs these unmasked calls so on CUDA and on CPU).
    attention = (
        2 * local * h * e
        + local * h
        + local * (q + 2 * kv) * e
        + max(2 * local * q * 4, 3 * local * q * e)
        + 2 * local * kv * e
        + local * q * (e + quant)
    )
    # MLP of the generation tower: layer inputs and residuals of both towers, the normed input
    # and its codes, then silu(gate) * up and down_proj's input quantization.
    mlp = 3 * local * h * e + rows * h * (e + 1) + rows * inter * max(3 * e, e + quant)
    phases = {"time embedding": time, "attention": attention, "MLP": mlp}
    if sp > 1:
        held = tokens * h * e  # the packed sequence the forward holds while its stack runs on slices
        phases["attention"] += held + ulysses_terms(shape, text, vision, rows, sp)
        phases["MLP"] += held
        # after the stack: every rank's rows gathered, then the whole sequence concatenated
        phases["gather"] = held + sp * rows * h * e + tokens * h * e
    return phases


def ulysses_terms(shape: TransformerShape, text: int, vision: int, rows: int, sp: int) -> int:
    """What a rank's attention adds under Ulysses: the q/k/v all-to-all's send and
    receive buffers (its rows, every head), every row of its share of the heads (q, k, v; the text
    keys and values of those heads beside them), the output's share and its inverse all-to-all.
    Key/value heads fewer than the degree are repeated to one per rank."""
    e, d = shape.dtype_bytes, shape.head_dim
    q, kv = shape.heads * d, max(shape.kv_heads, sp) * d
    exchange = 2 * rows * (q + 2 * kv) * e
    shares = vision * (q + 2 * kv) // sp * e + 2 * (text + vision) * kv // sp * e
    output = vision * q // sp * e + 2 * rows * q * e
    return exchange + shares + output


def _resident_layers(layer_bytes: list[int], resident: str | int, budget: int | None, prefetch: bool) -> int:
    """How many layers ``resident`` keeps gathered: none, all, a count, or auto: what the run's
    rule (``choose_resident``) keeps within ``budget`` bytes."""
    if (resident == "auto") != (budget is not None):
        raise ArgumentError(
            f"resident 'auto' needs resident_budget (the bytes the gathered layers may take), and only it "
            f"takes one: got resident {resident!r}, resident_budget {budget!r}"
        )
    if resident == "auto":
        from fsdp_fp8.runtime.residency import choose_resident

        return len(choose_resident(layer_bytes, budget, prefetch))
    n_resident = len(layer_bytes) if resident == "all" else 0 if resident == "none" else int(resident)
    if not 0 <= n_resident <= len(layer_bytes):
        raise ArgumentError(f"resident must be 'none', 'auto', 'all' or 0..{len(layer_bytes)} layers, got {resident!r}")
    return n_resident


def forecast(
    tensors: list[Tensor],
    shape: TransformerShape,
    size: VideoSize,
    world_size: int,
    *,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    components_bytes: int = 0,
    resident: str | int = "none",
    resident_budget: int | None = None,
    offload: str | None = None,
    cfg_parallel: bool = False,
    ulysses: int = 1,
    prefetch: bool = True,
    action: ActionChunk | None = None,
    mode: str = "",
) -> MemoryForecast:
    """The per-GPU forecast for ``tensors`` (the transformer's) sharded over ``world_size`` ranks;
    ``cfg_parallel`` / ``ulysses``: the ranks of one request (``runtime.parallel_layout``, checked
    there: a ``LayoutError``). ``resident``: none, all, a layer count, or auto: the layers the run's
    ``--resident auto`` keeps gathered within ``resident_budget`` bytes (``choose_resident``; the
    run also caps it at the free device memory, which a forecast does not know). ``action``: an
    action job's tokens beside ``size`` (already fitted: ``action_video_size``); ``mode``: its words."""
    ParallelLayout(world_size, cfg_parallel=cfg_parallel, ulysses=ulysses)
    if offload not in (None, "cpu"):
        raise ArgumentError(f"offload must be None or 'cpu', got {offload!r}")
    groups = units(tensors)
    layers = sorted((k for k in groups if k.startswith("layers.")), key=lambda k: int(k.split(".")[1]))
    full = {k: sum(_nbytes(t) for t in v) for k, v in groups.items()}
    shard = {k: sum(_shard_bytes(t, world_size) for t in v) for k, v in groups.items()}
    n_resident = _resident_layers([full[k] for k in layers], resident, resident_budget, prefetch)
    streamed = layers[n_resident:]
    biggest = max((full[k] for k in streamed), default=0)
    in_flight = (2 if prefetch else 1) * biggest if world_size > 1 else 0
    sharded = sum(shard.values())
    terms = []
    if offload == "cpu":
        flight_shards = (2 if prefetch else 1) * max((shard[k] for k in streamed), default=0)
        terms.append(
            Term("sharded weights", flight_shards, sharded, "host: pinned shards; device: the units in flight")
        )
    else:
        terms.append(Term("sharded weights", sharded, detail=f"{len(tensors)} tensors over {world_size} rank(s)"))
    if world_size > 1:
        others = [k for k in groups if k != "root" and not k.startswith("layers.")]
        root = full.get("root", 0) + sum(full[k] for k in others)  # float32 units: gathered transiently
        terms.append(Term("root unit, gathered", root, detail="embeddings, heads, proj_in/out: never resharded"))
        terms.append(
            Term(
                "decoder layers in flight",
                in_flight,
                detail=f"largest layer {_gib(biggest)} x {2 if prefetch else 1} (running + prefetched)",
            )
        )
        if n_resident:
            terms.append(
                Term("resident layers", sum(full[k] for k in layers[:n_resident]), detail=f"{n_resident} kept gathered")
            )
    terms.append(Term("non-FP8 components", components_bytes, detail="VAE and other component weights"))
    text = text_tokens
    fp8_time = any(t.key.startswith("time_embedder.") and t.itemsize == 1 for t in tensors)
    vision, actions = size.vision_tokens(shape.patch), action.chunk_size if action is not None else 0
    terms += activation_terms(shape, text, vision, cfg_parallel, fp8_time, ulysses, actions)
    return MemoryForecast(world_size, text, vision, tuple(terms), actions, mode, size)


# --- from a pipeline root or a transformer directory -----------------------------------------


def checkpoint_tensors(transformer_dir: Path) -> list[Tensor]:
    """Every tensor of the checkpoint at ``transformer_dir`` (headers only)."""
    from fsdp_fp8.format.checkpoint import open_checkpoint

    with open_checkpoint(transformer_dir) as ckpt:
        return [Tensor(e.key, tuple(e.shape), e.torch_dtype.itemsize) for e in ckpt.tensors.values()]


def components_bytes(root: Path) -> int:
    """Bytes of every component but the transformer: their safetensors files' sizes."""
    total = 0
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "transformer"):
        total += sum(f.stat().st_size for f in sub.glob("*.safetensors"))
    return total


def forecast_checkpoint(
    path: str | Path,
    world_size: int,
    *,
    height: int,
    width: int,
    frames: int,
    action: ActionChunk | None = None,
    schedule: int | None = None,
    **options,
) -> MemoryForecast:
    """The forecast for a pipeline root (``model_index.json``) or a Cosmos 3 transformer directory.
    Configs the forecast divides by (the VAE's factors, the transformer's shape) that are no
    integer >= 1 are refused together in one ``CheckpointError``, before any arithmetic.
    ``action``: an action job (``height`` x ``width``: its first frame's; ``frames`` is its chunk's),
    refused for a transformer without ``action_gen``; ``schedule``: a distilled root's step count,
    named in the forecast's mode."""
    from fsdp_fp8.format.hub import resolve_hub_path
    from fsdp_fp8.format.pipeline_config import has_pipeline_index

    path = resolve_hub_path(path)
    is_pipeline = has_pipeline_index(path)  # model_index.json, or a modular (distilled) root's index
    transformer = path / "transformer" if is_pipeline else path
    where = str(transformer / "config.json")
    config = json.loads((transformer / "config.json").read_text())
    if config.get("_class_name") != "Cosmos3OmniTransformer":
        raise ArgumentError(
            f"{where}: `_class_name` is {config.get('_class_name')!r}; the activation forecast knows "
            "Cosmos3OmniTransformer only"
        )
    problems: list[str] = []
    factors = read_pipeline_factors(path, problems) if is_pipeline else None
    try:
        shape = TransformerShape.from_config(config, where)
    except CheckpointError as exc:
        problems += exc.problems
    if action is not None and config.get("action_gen") is not True:
        problems.append(f"{where} has no `action_gen`: its transformer takes no actions ({action.mode} asked)")
    raise_if_problems(problems, f"cannot forecast {path}")
    # An official VAE's factors where the config does not say (or there is no pipeline around it).
    spatial, temporal = (factors.spatial or 16, factors.temporal or 4) if factors else (16, 4)
    if action is not None:
        size = action_video_size(height, width, action, spatial, temporal)
    else:
        size = VideoSize(height, width, frames, spatial, temporal)
    return forecast(
        checkpoint_tensors(transformer),
        shape,
        size,
        world_size,
        components_bytes=components_bytes(path) if is_pipeline else 0,
        action=action,
        mode=mode_words(size.frames, action, schedule),
        **options,
    )


# --- from a config alone (the official checkpoints, before downloading them) ------------------

# The high-precision linears of the official Nano FP8 export (its ignore list).
OFFICIAL_IGNORE = ("proj_in", "proj_out", "time_embedder", "lm_head", "visual")


def config_tensors(config: dict, ignore: tuple[str, ...] = OFFICIAL_IGNORE) -> list[Tensor]:
    """The tensors a ModelOpt FP8 export of ``Cosmos3OmniTransformer(**config)`` holds: every
    linear weight outside ``ignore`` one byte per element (plus two float32 scales), the rest
    in BF16 (``time_embedder`` in float32). Built on the meta device: no memory, no download."""
    import torch
    from diffusers import Cosmos3OmniTransformer

    with torch.device("meta"):
        model = Cosmos3OmniTransformer.from_config(config)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    out = []
    for key, p in model.state_dict().items():
        module = key.rpartition(".")[0]
        quantized = module in linears and key.endswith(".weight") and not any(part in module for part in ignore)
        itemsize = 1 if quantized else 4 if key.startswith("time_embedder.") else 2
        out.append(Tensor(key, tuple(p.shape), itemsize))
        if quantized:
            out += [Tensor(module + ".weight_scale", (), 4), Tensor(module + ".input_scale", (), 4)]
    return out
