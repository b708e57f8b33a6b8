"""What a diffusers pipeline's component configs say about the sizes it generates, read and
checked without torch: the VAE's compression (``vae/config.json``: ``scale_factor_spatial``,
``scale_factor_temporal``) and the transformer's latent patch (``transformer/config.json``:
``latent_patch_size``, or ``patch_size``).

Each is a divisor: the latent is the picture over the VAE's factors, the tokens the latent over
the patch. So each must be an integer >= 1; a 0, a ``null`` or a string would end a run (or
``inspect``'s forecast) in a ``ZeroDivisionError`` or ``TypeError`` deep inside. A key that is
absent is left to the pipeline's own default (``None`` here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_fp8.format.handles import present, read_json_file

VAE_CONFIG = "vae/config.json"
TRANSFORMER_CONFIG = "transformer/config.json"
SPATIAL, TEMPORAL = "scale_factor_spatial", "scale_factor_temporal"
PATCH_KEYS = ("latent_patch_size", "patch_size")  # Cosmos 3's name, then the common one


@dataclass(frozen=True)
class PipelineFactors:
    """The divisors of a pipeline's sizes; ``None`` where its config does not say."""

    spatial: int | None  # height and width are multiples of it
    temporal: int | None  # a video has 1 + a multiple of it frames (the first frame is its own latent)
    patch: int | None  # latent pixels per token side
    vae_config: str  # where the VAE's factors were read, for messages
    # The transformer's config as read (its attention heads: ``runtime.parallel_layout.head_problems``),
    # so a caller that needs more of it does not read the file again; and where it was read.
    transformer: Mapping = field(default_factory=dict, compare=False, repr=False)
    transformer_config: str = TRANSFORMER_CONFIG


# A diffusers pipeline's component index: the classic one, and a modular pipeline's (read first by diffusers)
PIPELINE_INDEXES = ("model_index.json", "modular_model_index.json")


def has_pipeline_index(root: Path) -> bool:
    """Whether ``root`` is a diffusers pipeline root: it holds ``model_index.json`` or ``modular_model_index.json``."""
    return any((Path(root) / name).is_file() for name in PIPELINE_INDEXES)


def positive_int_problem(config: dict, key: str, where: str) -> str | None:
    """Why ``config[key]`` (present) is no integer >= 1, naming ``where`` and the value, or None."""
    value = config[key]
    if type(value) is int and value >= 1:  # not a bool, a float or a string
        return None
    return f"{where}: `{key}` is {value!r}; it must be an integer >= 1 (sizes are divided by it)"


def _optional(config: dict, key: str, where: str, problems: list[str]) -> int | None:
    if key not in config:
        return None
    problem = positive_int_problem(config, key, where)
    if problem:
        problems.append(problem)
        return None
    return config[key]


def read_pipeline_factors(root: Path, problems: list[str]) -> PipelineFactors:
    """The factors of the pipeline at ``root``; a factor that is no integer >= 1 is a problem
    (appended) and ``None``. Configs are read as every checkpoint JSON is (bounded, never a pipe)."""
    configs = {}
    for name in (VAE_CONFIG, TRANSFORMER_CONFIG):
        path = root / name
        configs[name] = (read_json_file(path, str(path), problems) if present(path) else None) or {}
    vae, transformer = configs[VAE_CONFIG], configs[TRANSFORMER_CONFIG]
    vae_where, transformer_where = str(root / VAE_CONFIG), str(root / TRANSFORMER_CONFIG)
    patch_key = next((k for k in PATCH_KEYS if k in transformer), PATCH_KEYS[0])
    return PipelineFactors(
        spatial=_optional(vae, SPATIAL, vae_where, problems),
        temporal=_optional(vae, TEMPORAL, vae_where, problems),
        patch=_optional(transformer, patch_key, transformer_where, problems),
        vae_config=vae_where,
        transformer=transformer,
        transformer_config=transformer_where,
    )
