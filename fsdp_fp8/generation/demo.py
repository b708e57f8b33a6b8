"""The embedded demo: a tiny deterministic Cosmos 3 pipeline, made on first use and cached.

It is a real diffusers ``Cosmos3OmniPipeline`` directory, laid out like the official FP8
builds (``model_index.json``, ``transformer/``, ``vae/``, ``sound_tokenizer/``, ``scheduler/``,
``text_tokenizer/``): a random ``Cosmos3OmniTransformer`` (2 layers, hidden 64, sound-capable) calibrated
on the pipeline's own denoising loop and written by ``fsdp_fp8.export_fp8`` in ModelOpt
static-FP8 layout with the published first/last-3 step policy, a random ``AutoencoderKLWan``
(spatial factor 4, temporal 4), a tiny random ``Cosmos3AVAEAudioTokenizer`` (``--sound``), a
``UniPCMultistepScheduler`` and a byte-level tokenizer
built here (256 bytes + the chat and vision special tokens). Nothing is downloaded.

Several torchrun ranks may call :func:`demo_checkpoint` at once: ``fsdp_fp8.export.cache``
builds it once under a file lock, into a temporary directory renamed into place; a damaged
cache fails its manifest check and is rebuilt.

Importing this module imports no torch (each function imports what it builds with): the
launcher checks sizes against the demo's VAE before torch loads (``fsdp_fp8.generation.inputs``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from fsdp_fp8.format.files import file_sha256
from fsdp_fp8.format.step_policy import PUBLISHED_POLICY

logger = logging.getLogger(__name__)

DEMO_SEED = 0
DEMO_STEP_POLICY = PUBLISHED_POLICY  # the published first/last-3 policy
DEMO_PROMPTS = ("a red fox jumps over a sleeping dog, golden hour", "a lighthouse in a storm at night")
DEMO_SIZE = {"num_frames": 1, "height": 32, "width": 32}  # one 32x32 image: a PNG
DEMO_CONDITIONED_FRAMES = 5  # image- or video-to-video: 1 + the VAE's temporal factor (two latent frames)
DEMO_CALIBRATION_STEPS = 8
DEMO_MAX_SHARD_SIZE = 150_000  # bytes: the ~0.4 MB transformer lands in a few shards
MANIFEST = "fsdp_fp8_manifest.json"
# Part of the cache's name: a demo cached by an earlier revision (revision 1 had no sound
# tokenizer) is never mistaken for this one
DEMO_REVISION = 2

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRANSFORMER_CONFIG = dict(
    head_dim=16,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    latent_channel=4,
    latent_patch_size=2,
    patch_latent_dim=16,
    rope_axes_dim=[4, 2, 2],
    enable_fps_modulation=False,
    # Sound: two more projections, made after every other module, so the vision weights drawn
    # from the seed are those of the demo without sound (its digests unchanged)
    sound_gen=True,
    sound_dim=8,
)
VAE_CONFIG = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[True, True],
    latents_mean=[0.0] * 4,
    latents_std=[1.0] * 4,
    scale_factor_spatial=4,
    scale_factor_temporal=4,
)
# A tiny Cosmos 3 audio tokenizer (diffusers' Cosmos3AVAEAudioTokenizer, random weights): --sound on the demo
SOUND_TOKENIZER_CONFIG = dict(
    sampling_rate=8000,  # the lowest rate of the mp4's AAC encoder
    vocoder_input_dim=8,
    dec_dim=8,
    dec_c_mults=(1, 2),
    dec_strides=(4, 4),
    enc_dim=8,
    enc_intermediate_dim=16,
    enc_num_layers=1,
    enc_num_blocks=1,
    enc_latent_dim=8,
    enc_c_mults=(1, 2),
    enc_strides=(4, 4),
)
SCHEDULER_CONFIG = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0)


def demo_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is a token, plus specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def demo_components(transformer_config: dict | None = None) -> dict:
    """The high-precision pipeline components, seeded: transformer (bf16), vae, sound tokenizer,
    scheduler, tokenizer."""
    import torch
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer, UniPCMultistepScheduler
    from diffusers.models.autoencoders.autoencoder_cosmos3_audio import Cosmos3AVAEAudioTokenizer

    from fsdp_fp8.third_party import quiet_warnings

    tokenizer = demo_tokenizer()
    torch.manual_seed(DEMO_SEED)
    transformer = Cosmos3OmniTransformer(vocab_size=len(tokenizer), **(transformer_config or TRANSFORMER_CONFIG))
    transformer = transformer.to(torch.bfloat16).eval()
    transformer.time_embedder.float()  # _keep_in_fp32_modules, as diffusers keeps it
    torch.manual_seed(DEMO_SEED + 1)
    vae = AutoencoderKLWan(**VAE_CONFIG).eval()
    torch.manual_seed(DEMO_SEED + 2)
    with quiet_warnings():  # torch's deprecation of a call inside diffusers' tokenizer
        sound_tokenizer = Cosmos3AVAEAudioTokenizer(**SOUND_TOKENIZER_CONFIG).eval()
    return {
        "transformer": transformer,
        "vae": vae,
        "sound_tokenizer": sound_tokenizer,
        "text_tokenizer": tokenizer,
        "scheduler": UniPCMultistepScheduler(**SCHEDULER_CONFIG),
    }


def _calibrate(components: dict):
    import torch
    from diffusers import Cosmos3OmniPipeline

    def run(transformer) -> None:
        pipe = Cosmos3OmniPipeline(**{**components, "transformer": transformer}, enable_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        for i, prompt in enumerate(DEMO_PROMPTS):
            pipe(
                prompt,
                **DEMO_SIZE,
                num_inference_steps=DEMO_CALIBRATION_STEPS,
                guidance_scale=3.0,
                generator=torch.Generator().manual_seed(DEMO_SEED + i),
                output_type="latent",
            )

    return run


# The action demo: the demo with an action-capable transformer (diffusers' `action_gen`: the
# domain-aware action projections, embeddings, never FP8), for --action jobs
ACTION_CONFIG = dict(action_gen=True, action_dim=10)
ACTION_DEMO_REVISION = 1
ACTION_DOMAIN = "pusht"  # 2 raw values per action
ACTION_IMAGE = 64  # pixels a side: at the 256 tier the canvas is 256 x 256, the content 64 x 64
ACTION_CHUNK = 4


def action_demo_image():
    """A seeded 64 x 64 first frame (PIL) for the action demo's calibration and tests."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(DEMO_SEED).integers(0, 256, (ACTION_IMAGE, ACTION_IMAGE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _calibrate_actions(components: dict):
    import torch
    from diffusers import Cosmos3OmniPipeline
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    def run(transformer) -> None:
        pipe = Cosmos3OmniPipeline(**{**components, "transformer": transformer}, enable_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        for i, prompt in enumerate(DEMO_PROMPTS):
            generator = torch.Generator().manual_seed(DEMO_SEED + i)
            actions = torch.randn(ACTION_CHUNK, 2, generator=generator)
            condition = CosmosActionCondition(
                mode="forward_dynamics",
                chunk_size=ACTION_CHUNK,
                domain_name=ACTION_DOMAIN,
                resolution_tier=256,
                raw_actions=actions,
                image=action_demo_image(),
            )
            pipe(
                prompt,
                action=condition,
                num_inference_steps=2,
                guidance_scale=3.0,
                generator=generator,
                output_type="latent",
            )

    return run


def build_demo_pipeline(directory: str | os.PathLike, action: bool = False) -> Path:
    """Write the demo pipeline into the empty or missing ``directory`` (no cache, no manifest);
    ``action``: its transformer action-capable (``ACTION_CONFIG``), calibrated on forward dynamics."""
    from fsdp_fp8.export.modelopt import DEFAULT_IGNORE, export_fp8
    from fsdp_fp8.interop.cosmos import SOUND_PROJECTIONS  # its calibration (text to image) never runs them

    directory = Path(directory)
    components = demo_components({**TRANSFORMER_CONFIG, **ACTION_CONFIG} if action else None)
    transformer = components["transformer"]
    config = json.loads(transformer.to_json_string())
    export_fp8(
        transformer,
        directory / "transformer",
        config=config,
        calibrate=_calibrate_actions(components) if action else _calibrate(components),
        ignore=(*DEFAULT_IGNORE, *SOUND_PROJECTIONS),
        step_policy=DEMO_STEP_POLICY,
        max_shard_size=DEMO_MAX_SHARD_SIZE,
    )
    components["vae"].save_pretrained(directory / "vae")
    components["sound_tokenizer"].save_pretrained(directory / "sound_tokenizer")
    components["scheduler"].save_pretrained(directory / "scheduler")
    components["text_tokenizer"].save_pretrained(directory / "text_tokenizer")
    index = {
        "_class_name": "Cosmos3OmniPipeline",
        "_diffusers_version": config["_diffusers_version"],
        "default_use_system_prompt": True,
        "enable_safety_checker": False,
        "safety_checker": [None, None],
        "scheduler": ["diffusers", type(components["scheduler"]).__name__],
        "sound_tokenizer": ["diffusers", "Cosmos3AVAEAudioTokenizer"],
        "text_tokenizer": ["transformers", type(components["text_tokenizer"]).__name__],
        "transformer": ["diffusers", "Cosmos3OmniTransformer"],
        "use_native_flow_schedule": False,
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (directory / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return directory


# The distilled demo: the same random components as a 4-step distilled root (diffusers'
# Cosmos3DistilledModularPipeline: its `modular_model_index.json`, a fixed `distilled_sigmas` schedule,
# a FlowMatchEulerDiscreteScheduler), the transformer exported without a step policy (every step W8A8)
DISTILLED_SIGMAS = (1.0, 0.75, 0.5, 0.25)
DISTILLED_REVISION = 1


def _distilled_index(config: dict) -> dict:
    """``modular_model_index.json`` as diffusers' ``save_pretrained`` writes it; the components'
    ``pretrained_model_name_or_path`` a Hub id, as in a published root: a local copy's folders are
    read all the same (``fsdp_fp8.interop.modular``)."""

    def entry(library: str, cls: str, folder: str) -> list:
        spec = {"pretrained_model_name_or_path": "fsdp-fp8/cosmos3-distilled-demo", "revision": None}
        return [library, cls, {**spec, "subfolder": folder, "type_hint": [library, cls], "variant": None}]

    return {
        "_blocks_class_name": "Cosmos3DistilledBlocks",
        "_class_name": "Cosmos3DistilledModularPipeline",
        "_diffusers_version": config["_diffusers_version"],
        "default_use_system_prompt": True,
        "distilled_sigmas": list(DISTILLED_SIGMAS),
        "enable_safety_checker": False,
        "is_distilled": True,
        "scheduler": entry("diffusers", "FlowMatchEulerDiscreteScheduler", "scheduler"),
        "text_tokenizer": entry("transformers", "PreTrainedTokenizerFast", "text_tokenizer"),
        "transformer": entry("diffusers", "Cosmos3OmniTransformer", "transformer"),
        "vae": entry("diffusers", "AutoencoderKLWan", "vae"),
    }


def build_distilled_pipeline(directory: str | os.PathLike) -> Path:
    """Write the distilled demo into the empty or missing ``directory``: the demo's random
    components, calibrated through diffusers' own ``Cosmos3DistilledModularPipeline`` loaded from
    this directory, the transformer written by ``export_fp8`` with no step policy."""
    import torch
    from diffusers import Cosmos3DistilledModularPipeline, FlowMatchEulerDiscreteScheduler

    from fsdp_fp8.export.modelopt import DEFAULT_IGNORE, export_fp8
    from fsdp_fp8.interop.cosmos import SOUND_PROJECTIONS
    from fsdp_fp8.interop.modular import blocks_of, load_modular

    directory = Path(directory)
    components = demo_components()
    transformer = components["transformer"]
    config = json.loads(transformer.to_json_string())
    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(directory / "scheduler")
    components["vae"].save_pretrained(directory / "vae")
    components["text_tokenizer"].save_pretrained(directory / "text_tokenizer")
    (directory / "modular_model_index.json").write_text(json.dumps(_distilled_index(config), indent=2) + "\n")

    def calibrate(model) -> None:  # diffusers' own distilled pipeline, read from this directory as a load reads it
        cls, index = Cosmos3DistilledModularPipeline, _distilled_index(config)
        blocks = blocks_of(cls, index, directory)  # progress bars off
        pipe = load_modular(cls, directory, blocks, model, {"enable_safety_checker": False})
        for i, prompt in enumerate(DEMO_PROMPTS):
            generator = torch.Generator().manual_seed(DEMO_SEED + i)
            pipe(prompt=prompt, **DEMO_SIZE, generator=generator, output_type="latent", output="videos")

    export_fp8(
        transformer,
        directory / "transformer",
        config=config,
        calibrate=calibrate,
        ignore=(*DEFAULT_IGNORE, *SOUND_PROJECTIONS),
        step_policy=None,
        max_shard_size=DEMO_MAX_SHARD_SIZE,
    )
    return directory


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _is_complete(directory: Path) -> bool:
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
        return bool(files) and all(file_sha256(directory / name) == sha for name, sha in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _build(directory: Path, build=None) -> None:
    started = time.perf_counter()
    (build or build_demo_pipeline)(directory)
    files = {str(p.relative_to(directory)): file_sha256(p) for p in _files(directory)}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=2, sort_keys=True) + "\n")
    logger.info("built the demo pipeline in %.1f s", time.perf_counter() - started)


def demo_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the demo pipeline root ``<cache>/cosmos3-demo-<version>``, building it on first call.

    ``cache_dir`` defaults to ``$FSDP_FP8_CACHE``, else ``~/.cache/fsdp_fp8``.
    """
    from fsdp_fp8.export.cache import build_once
    from fsdp_fp8.format.writer import producer_version

    default = os.environ.get("FSDP_FP8_CACHE") or Path.home() / ".cache" / "fsdp_fp8"
    name = f"cosmos3-demo-{producer_version()}-r{DEMO_REVISION}"
    return build_once(Path(cache_dir or default) / name, _build, _is_complete)


def distilled_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the distilled demo root ``<cache>/cosmos3-distilled-demo-<version>``, built on
    first call (``cache_dir`` as ``demo_checkpoint``'s)."""
    from fsdp_fp8.export.cache import build_once
    from fsdp_fp8.format.writer import producer_version

    default = os.environ.get("FSDP_FP8_CACHE") or Path.home() / ".cache" / "fsdp_fp8"
    name = f"cosmos3-distilled-demo-{producer_version()}-r{DISTILLED_REVISION}"
    return build_once(Path(cache_dir or default) / name, lambda d: _build(d, build_distilled_pipeline), _is_complete)


def action_demo_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the action demo root ``<cache>/cosmos3-action-demo-<version>``, built on first call
    (``cache_dir`` as ``demo_checkpoint``'s)."""
    from fsdp_fp8.export.cache import build_once
    from fsdp_fp8.format.writer import producer_version

    default = os.environ.get("FSDP_FP8_CACHE") or Path.home() / ".cache" / "fsdp_fp8"
    name = f"cosmos3-action-demo-{producer_version()}-r{ACTION_DEMO_REVISION}"
    return build_once(
        Path(cache_dir or default) / name,
        lambda d: _build(d, lambda root: build_demo_pipeline(root, action=True)),
        _is_complete,
    )
