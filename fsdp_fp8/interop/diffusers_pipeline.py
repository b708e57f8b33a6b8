"""A diffusers pipeline's own files: ``model_index.json`` (or a modular pipeline's
``modular_model_index.json``, read first, as diffusers reads it) checked before anything is loaded,
and the pipeline class it names (from diffusers itself, never from the checkpoint).

    pipeline root (modular_model_index.json or model_index.json)
      transformer/   -> loaded by fsdp_fp8 (``fsdp_fp8.load_pipeline``)
      vae/, scheduler/, text_tokenizer/, ...  -> diffusers / transformers from_pretrained, same directory
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fsdp_fp8.errors import ArgumentError, CheckpointError
from fsdp_fp8.format.pipeline_config import has_pipeline_index
from fsdp_fp8.format.remote_code import remote_code_references

MODEL_INDEX = "model_index.json"
MODULAR_INDEX = "modular_model_index.json"  # a ModularPipeline's: entries [library, class, loading spec]
TRANSFORMER = "transformer"
DISTILLED_SIGMAS = "distilled_sigmas"  # Cosmos3DistilledModularPipeline's fixed schedule (diffusers 0.42)
log = logging.getLogger(__name__)


def index_path(root: Path) -> Path:
    """The pipeline's index: ``modular_model_index.json`` where there is one (diffusers' modular
    pipelines read it first), else ``model_index.json``."""
    return root / MODULAR_INDEX if (root / MODULAR_INDEX).is_file() else root / MODEL_INDEX


def is_pipeline_index(root: Path) -> bool:
    return has_pipeline_index(root)


def _is_entry(entry) -> bool:
    """A component entry: ``[library, class]``, or a modular index's ``[library, class, spec]``."""
    return isinstance(entry, list) and len(entry) in (2, 3) and (len(entry) == 2 or isinstance(entry[2], dict))


def read_model_index(root: Path) -> dict:
    path = index_path(root)
    if not path.is_file():
        raise FileNotFoundError(
            f"{root} has no {MODEL_INDEX} (nor {MODULAR_INDEX}): not a diffusers pipeline root "
            "(load a transformer directory alone with fsdp_fp8.load_model)"
        )
    try:
        index = json.loads(path.read_text())
    except ValueError as exc:
        raise ArgumentError(f"{path}: not valid JSON ({exc})") from None
    problems = []
    if not isinstance(index.get("_class_name"), str):
        problems.append(f"`_class_name` is {index.get('_class_name')!r}, not a pipeline class name")
    entry = index.get(TRANSFORMER)
    if not (_is_entry(entry) and entry[0] == "diffusers"):
        problems.append(f"`{TRANSFORMER}` is {entry!r}, not a diffusers model entry")
    elif not (root / TRANSFORMER / "config.json").is_file():
        problems.append(f"`{TRANSFORMER}` is listed but {root / TRANSFORMER / 'config.json'} does not exist")
    sigmas = index.get(DISTILLED_SIGMAS)
    if sigmas is not None and not (
        isinstance(sigmas, list)
        and sigmas
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in sigmas)
    ):
        problems.append(f"`{DISTILLED_SIGMAS}` is {sigmas!r}, not a list of numbers (the distilled schedule)")
    references, unreadable = remote_code_references(root)
    problems += unreadable
    for ref in references:
        if ref.startswith((MODEL_INDEX, MODULAR_INDEX)):  # a component diffusers would import from the checkpoint
            problems.append(ref)
        else:  # an `auto_map` transformers ignores under trust_remote_code=False
            log.warning("%s: %s; ignored (fsdp_fp8 never runs code from a checkpoint)", root, ref)
    if problems:
        raise CheckpointError(problems, str(path))
    return index


# The libraries whose components ``from_pretrained`` reads from a folder of the root's own name
FOLDER_LIBRARIES = ("diffusers", "transformers")
SAFETY_CHECKER = "safety_checker"  # the guardrail: its own package, checked by ``guardrail_problem``


def missing_components(root: Path, index: dict, components: dict | None = None) -> list[str]:
    """The components ``model_index.json`` (``index``) names whose folder under ``root`` is
    missing, each naming the component and the folder (sorted); ``components``: those the caller
    hands ``from_pretrained`` itself (not read from a folder). Without this a missing folder is
    diffusers' "no file named config.json" after the transformer's whole load."""
    components = components or {}
    problems = []
    for name, entry in sorted(index.items()):
        if name.startswith("_") or name in (TRANSFORMER, SAFETY_CHECKER) or name in components:
            continue
        if not (_is_entry(entry) and entry[0] in FOLDER_LIBRARIES and entry[1]):
            continue  # [null, null]: a component the pipeline goes without
        folder = root / (entry[2].get("subfolder") or name if len(entry) == 3 else name)
        if not folder.is_dir():  # a modular entry pointing elsewhere: read from this root all the same
            problems.append(
                f"{index_path(root)} names the component `{name}` ({entry[0]}.{entry[1]}), but its folder "
                f"{folder} does not exist"
            )
    return problems


GUARDRAIL_PACKAGE = "cosmos_guardrail"  # diffusers' Cosmos pipelines: from cosmos_guardrail import CosmosSafetyChecker


def guardrail_problem(index: dict, components: dict | None = None) -> str | None:
    """Why the pipeline of this ``model_index.json`` cannot be built as it asks: a Cosmos pipeline
    (one whose index sets ``enable_safety_checker`` or names the guardrail as its
    ``safety_checker``) builds ``CosmosSafetyChecker`` when ``enable_safety_checker`` is on (its
    default), which needs the ``cosmos_guardrail`` package. None when it is installed, when the
    caller's ``components`` (``from_pretrained`` keyword arguments) turn it off or give a checker."""
    import importlib.util

    components = components or {}
    entry = index.get("safety_checker")
    guarded = "enable_safety_checker" in index or (isinstance(entry, list) and entry[:1] == [GUARDRAIL_PACKAGE])
    on = components.get("enable_safety_checker", index.get("enable_safety_checker", True))
    if not (guarded and on) or components.get("safety_checker") is not None:
        return None
    if importlib.util.find_spec(GUARDRAIL_PACKAGE) is not None:
        return None
    return (
        f"its {MODEL_INDEX} turns the safety checker on (`enable_safety_checker`; `safety_checker` {entry!r}) "
        f"and its package `{GUARDRAIL_PACKAGE}` is not installed (pip install {GUARDRAIL_PACKAGE})"
    )


def pipeline_class(name: str, source: Path):
    """The pipeline class ``_class_name`` names: a ``DiffusionPipeline`` or a ``ModularPipeline`` of
    diffusers itself."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline | diffusers.ModularPipeline)):
        raise ArgumentError(f"{source}: `_class_name` {name!r} is not a pipeline of diffusers {diffusers.__version__}")
    return cls


def is_modular(cls: type) -> bool:
    """Whether ``cls`` is one of diffusers' modular pipelines (blocks, not one ``__call__``)."""
    import diffusers

    return issubclass(cls, diffusers.ModularPipeline)


def distilled_steps(index: dict) -> int | None:
    """The step count of the fixed schedule a distilled root's index gives (``distilled_sigmas``:
    diffusers' ``Cosmos3DistilledSetTimestepsStep`` runs exactly those), else None."""
    sigmas = index.get(DISTILLED_SIGMAS)
    return len(sigmas) if isinstance(sigmas, list) and sigmas else None


def schedule_of(root: Path) -> int | None:
    """The fixed step count of a distilled root (its index's ``distilled_sigmas``), else None
    (no index, or one that cannot be read: the load says what is wrong with it)."""
    try:
        index = json.loads(index_path(root).read_text())
    except (OSError, ValueError):
        return None
    return distilled_steps(index) if isinstance(index, dict) else None


def distilled_problems(where: str, steps: int, guidance: float, schedule: int) -> list[str]:
    """diffusers' own refusals of a distilled pipeline (``Cosmos3DistilledSetTimestepsStep``),
    made before anything runs: a step count other than the schedule's, guidance other than 1.0."""
    problems = []
    if steps != schedule:
        problems.append(
            f"{where}: this is a distilled checkpoint; the step count is fixed by the pipeline's "
            f"`{DISTILLED_SIGMAS}` config ({schedule} steps): steps must be {schedule}, got {steps}"
        )
    if guidance != 1.0:
        problems.append(
            f"{where}: this is a distilled checkpoint; classifier-free guidance is baked into the weights: "
            f"guidance must be 1.0, got {guidance}"
        )
    return problems
