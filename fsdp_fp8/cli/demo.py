"""A deterministic demo FP8 checkpoint of the reference MoT model, made on first use and cached.

Several torchrun ranks may call :func:`demo_checkpoint` at once: ``fsdp_fp8.export.cache``
builds it once under a file lock, into a temporary directory renamed into place; a damaged
cache fails its manifest check and is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from fsdp_fp8.format.files import file_sha256
from fsdp_fp8.export.cache import build_once
from fsdp_fp8.export.modelopt import export_fp8
from fsdp_fp8.format.writer import producer_version
from fsdp_fp8.models import PRESETS, ReferenceMoTTransformer, build_model, init_weights
from fsdp_fp8.runtime.sampler import sample
from fsdp_fp8.format.step_policy import PUBLISHED_POLICY

logger = logging.getLogger(__name__)

DEMO_PRESET = "demo"
DEMO_SEED = 0
DEMO_PROMPT_TOKENS = 16
DEMO_LATENT_TOKENS = 64
DEMO_CALIBRATION_STEPS = 8
DEMO_MAX_SHARD_SIZE = 3_000_000  # bytes: the ~7.5 MB demo lands in a few shards
DEMO_STEP_POLICY = PUBLISHED_POLICY  # the published first/last-3 policy
MANIFEST = "fsdp_fp8_manifest.json"


def demo_prompt_ids(batch: int = 1) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(DEMO_SEED + 1)
    vocab = PRESETS[DEMO_PRESET].vocab_size
    return torch.randint(0, vocab, (batch, DEMO_PROMPT_TOKENS), generator=gen)


def demo_model() -> ReferenceMoTTransformer:
    """The high-precision (BF16) demo model the checkpoint is quantized from."""
    return init_weights(build_model(PRESETS[DEMO_PRESET], device="cpu"), seed=DEMO_SEED)


def _calibrate(model: ReferenceMoTTransformer) -> None:
    sample(model, demo_prompt_ids(), steps=DEMO_CALIBRATION_STEPS, seed=DEMO_SEED,
           num_latent_tokens=DEMO_LATENT_TOKENS)


def _is_complete(directory: Path) -> bool:
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
        return all(file_sha256(directory / name) == sha for name, sha in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _build(directory: Path) -> None:
    started = time.perf_counter()
    model = demo_model()
    export_fp8(
        model, directory, config=model.config.to_config_dict(), calibrate=_calibrate,
        step_policy=DEMO_STEP_POLICY, max_shard_size=DEMO_MAX_SHARD_SIZE,
    )
    files = {p.name: file_sha256(p) for p in sorted(directory.iterdir())}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=2, sort_keys=True) + "\n")
    logger.info("built demo checkpoint in %.1f s", time.perf_counter() - started)


def demo_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the demo checkpoint ``<cache>/demo-<version>``, building it on first call.

    ``cache_dir`` defaults to ``$FSDP_FP8_CACHE``, else ``~/.cache/fsdp_fp8``.
    """
    default = os.environ.get("FSDP_FP8_CACHE") or Path.home() / ".cache" / "fsdp_fp8"
    return build_once(Path(cache_dir or default) / f"demo-{producer_version()}", _build, _is_complete)
