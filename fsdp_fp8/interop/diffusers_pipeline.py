"""A diffusers pipeline's own files: ``model_index.json`` checked before anything is loaded, and the
pipeline class it names (from diffusers itself, never from the checkpoint).

    pipeline root (model_index.json)
      transformer/   -> loaded by fsdp_fp8 (``fsdp_fp8.load_pipeline``)
      vae/, scheduler/, text_tokenizer/, ...  -> diffusers / transformers from_pretrained, same directory
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fsdp_fp8.errors import ArgumentError, CheckpointError
from fsdp_fp8.format.remote_code import remote_code_references

MODEL_INDEX = "model_index.json"
TRANSFORMER = "transformer"
log = logging.getLogger(__name__)


def read_model_index(root: Path) -> dict:
    index_path = root / MODEL_INDEX
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{root} has no {MODEL_INDEX}: not a diffusers pipeline root "
            "(load a transformer directory alone with fsdp_fp8.load_model)"
        )
    try:
        index = json.loads(index_path.read_text())
    except ValueError as exc:
        raise ArgumentError(f"{index_path}: not valid JSON ({exc})") from None
    problems = []
    if not isinstance(index.get("_class_name"), str):
        problems.append(f"`_class_name` is {index.get('_class_name')!r}, not a pipeline class name")
    entry = index.get(TRANSFORMER)
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers"):
        problems.append(f"`{TRANSFORMER}` is {entry!r}, not a diffusers model entry")
    elif not (root / TRANSFORMER / "config.json").is_file():
        problems.append(f"`{TRANSFORMER}` is listed but {root / TRANSFORMER / 'config.json'} does not exist")
    references, unreadable = remote_code_references(root)
    problems += unreadable
    for ref in references:
        if ref.startswith("model_index.json"):  # a component diffusers would import from the checkpoint
            problems.append(ref)
        else:  # an `auto_map` transformers ignores under trust_remote_code=False
            log.warning("%s: %s; ignored (fsdp_fp8 never runs code from a checkpoint)", root, ref)
    if problems:
        raise CheckpointError(problems, str(index_path))
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
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in FOLDER_LIBRARIES and entry[1]):
            continue  # [null, null]: a component the pipeline goes without
        if not (root / name).is_dir():
            problems.append(
                f"{root / MODEL_INDEX} names the component `{name}` ({entry[0]}.{entry[1]}), but its folder "
                f"{root / name} does not exist"
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
    import diffusers

    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise ArgumentError(f"{source}: `_class_name` {name!r} is not a pipeline of diffusers {diffusers.__version__}")
    return cls
