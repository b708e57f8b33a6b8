"""Never run code from a checkpoint directory: what to pass to Hugging Face loaders, and what to report.

transformers and diffusers can import Python files shipped inside a checkpoint (a config's or
tokenizer config's ``auto_map``, a pipeline component from a custom module). With
``trust_remote_code=None`` transformers *asks on stdin*, and a "y" (or a piped stdin) runs the
code. Every ``from_pretrained`` / ``load_config`` call in fsdp_fp8 therefore passes
``SAFE_PRETRAINED_KWARGS`` (never trust, never download, never prompt), and
``remote_code_references`` names each place a directory asks for custom code, so the caller
can report it before it is ignored (or refuse). The check reads JSON only, through the same
bounded, non-blocking reader as the checkpoint itself; it imports neither library.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format.handles import present, read_json_file, short_repr
from fsdp_fp8.format.pipeline_config import PIPELINE_INDEXES

# trust_remote_code=False: never import checkpoint code and never prompt (transformers asks
# only when it is None). local_files_only=True: nothing is fetched from the Hub.
SAFE_PRETRAINED_KWARGS = {"trust_remote_code": False, "local_files_only": True}

# Files whose ``auto_map`` names custom classes (transformers), and a pipeline's model_index.json
# whose components may name a module other than a library's (diffusers).
AUTO_MAP_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "image_processor_config.json",
    "feature_extractor_config.json",
    "video_preprocessor_config.json",
    "modular_config.json",  # a modular pipeline's custom blocks (diffusers' trust_remote_code)
    "modular_model_index.json",
)
KNOWN_LIBRARIES = frozenset({"diffusers", "transformers"})
# Components a pipeline imports from an installed package of its own (the Cosmos pipelines'
# guardrail: ``from cosmos_guardrail import CosmosSafetyChecker``), never from the checkpoint:
# (key, module, class). Allowed while the checkpoint holds no file or folder of that module's name.
INSTALLED_COMPONENTS = frozenset({("safety_checker", "cosmos_guardrail", "CosmosSafetyChecker")})


def safe_pretrained_kwargs(**extra) -> dict:
    """``SAFE_PRETRAINED_KWARGS`` plus ``extra``; an ``extra`` that would trust remote code is refused."""
    if extra.get("trust_remote_code") or extra.get("custom_pipeline") is not None:
        raise ArgumentError(
            "fsdp_fp8 never runs code from a checkpoint: trust_remote_code / custom_pipeline cannot be set",
            "from_pretrained keywords",
        )
    return {**extra, **SAFE_PRETRAINED_KWARGS}


def remote_code_references(directory: str | Path, subfolders: bool = True) -> tuple[list[str], list[str]]:
    """(references to custom code, problems reading the files) in ``directory`` and, with
    ``subfolders``, its direct subdirectories (a diffusers pipeline's components).

    A reference names the file and the key: ``tokenizer_config.json: `auto_map` names custom
    code {...}``. Unreadable or malformed files are problems, not references.
    """
    directory = Path(directory)
    places = [directory]
    if subfolders:
        try:
            places += sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError as exc:
            return [], [f"{directory}: cannot list: {type(exc).__name__}: {exc.strerror or exc}"]
    found, problems = [], []
    for place in places:
        prefix = "" if place == directory else f"{place.name}/"
        for name in AUTO_MAP_FILES:
            obj = _read(place / name, prefix + name, problems)
            if obj is not None and obj.get("auto_map"):
                found.append(f"{prefix}{name}: `auto_map` names custom code {short_repr(obj['auto_map'])}")
        for index_name in PIPELINE_INDEXES:  # a modular pipeline's entries add a loading spec (3 items)
            index = _read(place / index_name, prefix + index_name, problems)
            for key, value in sorted((index or {}).items()):
                if (
                    isinstance(value, list)
                    and len(value) in (2, 3)
                    and isinstance(value[0], str)
                    and value[0] not in KNOWN_LIBRARIES
                    and not _installed_component(place, key, value[:2])
                ):
                    found.append(
                        f"{prefix}{index_name}: `{key}` comes from module {value[0]!r}, "
                        "custom code inside the checkpoint"
                    )
    return found, problems


def _installed_component(place: Path, key: str, value: list) -> bool:
    """``value`` is an ``INSTALLED_COMPONENTS`` entry that nothing in ``place`` could shadow."""
    module = value[0]
    shadowed = (place / f"{module}.py").exists() or (place / module).exists()
    return (key, module, value[1]) in INSTALLED_COMPONENTS and not shadowed


def _read(path: Path, name: str, problems: list[str]) -> dict | None:
    if not present(path):
        return None
    return read_json_file(path, name, problems)
