"""Detect and validate the ModelOpt quantization config of a checkpoint directory.

The same fact is spelled three ways (see docs/checkpoint-format.md): ``hf_quant_config.json``
nested or flat, and ``config.json["quantization_config"]``. Every spelling present is parsed
and checked; they must agree. Any config that is present but says something other than
ModelOpt static per-tensor FP8 is refused, because loading quantized bytes as if they were
plain weights is the worst failure this library can have. Unknown keys inside a quantization
block are refused too: we cannot know they do not change what the bytes mean.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.format.handles import present, read_json_file, short_repr
from fsdp_fp8.format.step_policy import check_step_policy

NESTED = "hf_quant_config.json (nested)"
FLAT = "hf_quant_config.json (flat)"
CONFIG_JSON = "config.json quantization_config"

_NESTED_TOP = {"producer", "quantization"}
# Writers of the ModelOpt static-FP8 layout: ModelOpt itself, and fsdp_fp8's own exporter
# (fsdp_fp8.export.modelopt), which writes the same files and names itself honestly.
PRODUCERS = frozenset({"modelopt", "fsdp_fp8"})
_NESTED_QUANT = {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}
_FLAT = {"quant_method", "quant_algo", "kv_cache_quant_algo", "exclude_modules", "ignore", "producer"}
_CONFIG = {"quant_method", "quant_algo", "ignore", "config_groups", "kv_cache_scheme", "producer", "runtime"}
_GROUP = {"weights", "input_activations", "targets"}
_SCHEME = {"num_bits", "type", "dynamic", "strategy"}


@dataclass(frozen=True)
class QuantConfig:
    is_modelopt_fp8: bool
    spellings: tuple[str, ...] = ()
    producer: str | None = None  # "modelopt 0.47.0"
    ignore: tuple[str, ...] = ()  # module-name patterns, fnmatch syntax
    kv_cache_quant_algo: str | None = None  # None or "FP8"
    step_policy: dict | None = None  # raw runtime.diffusion_step_policy; parsed elsewhere

    def is_ignored(self, module: str) -> bool:
        matcher = self.__dict__.get("_matcher")
        if matcher is None:  # built once per config: matching every module stays linear
            matcher = ignore_matcher(self.ignore)
            object.__setattr__(self, "_matcher", matcher)
        return matcher(module)


def ignore_matcher(patterns) -> Callable[[str], bool]:
    """``matcher(module)``: does ``module`` match a pattern? ModelOpt ignore lists hold module
    names with fnmatch wildcards (`model.layers.1*`). Real lists are mostly plain names (every
    MoE router of a model) and a few wildcards: plain names go in a set, so matching each module
    costs a set look-up plus the wildcards, not the whole list."""
    patterns = tuple(patterns)
    literal = frozenset(p for p in patterns if not any(c in p for c in "*?["))
    wild = [re.compile(fnmatch.translate(p)).match for p in dict.fromkeys(patterns) if p not in literal]
    return lambda module: module in literal or any(match(module) for match in wild)


def matches_ignore(module: str, patterns) -> bool:
    """One name against ``patterns``; for many names build one ``ignore_matcher``."""
    return ignore_matcher(patterns)(module)


PLAIN = QuantConfig(is_modelopt_fp8=False)


@dataclass
class _Parsed:
    """One spelling, normalised. ``None`` means "this spelling does not say"."""

    spelling: str
    ignore: tuple[str, ...] | None = None
    kv: str | None | type(...) = ...  # Ellipsis: unspecified (flat spelling may omit it)
    producer: str | None = None
    step_policy: dict | None = None


def _where(file: str, field: str) -> str:
    return f"{file}: field `{field}`"


def _unknown(obj: dict, known: set[str], file: str, prefix: str, problems: list[str]) -> None:
    for key in sorted(obj.keys() - known):
        problems.append(f"{_where(file, prefix + key)} is not understood; refusing rather than ignoring it")


def _expect(obj: dict, key: str, want: object, file: str, prefix: str, problems: list[str]) -> None:
    value = obj.get(key, ...)
    if value is ...:
        problems.append(f"{_where(file, prefix + key)} is missing (expected {short_repr(want)})")
    elif value != want or type(value) is not type(want):
        problems.append(f"{_where(file, prefix + key)} is {short_repr(value)}; only {short_repr(want)} is supported")


def _producer(obj: dict, file: str, prefix: str, problems: list[str]) -> str | None:
    raw = obj.get("producer")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str) for k in ("name", "version")):
        problems.append(
            f"{_where(file, prefix + 'producer')} must be {{'name': str, 'version': str}}, got {short_repr(raw)}"
        )
        return None
    if raw["name"] not in PRODUCERS:
        problems.append(
            f"{_where(file, prefix + 'producer.name')} is {short_repr(raw['name'])}; supported: {sorted(PRODUCERS)}"
        )
    return f"{raw['name']} {raw['version']}"


def _patterns(obj: dict, key: str, file: str, prefix: str, problems: list[str]) -> tuple[str, ...] | None:
    raw = obj.get(key)
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(p, str) for p in raw):
        problems.append(f"{_where(file, prefix + key)} must be a list of module-name strings, got {short_repr(raw)}")
        return None
    return tuple(raw)


def _kv_algo(obj: dict, key: str, file: str, prefix: str, problems: list[str]):
    if key not in obj:
        return ...
    value = obj[key]
    if value not in (None, "FP8"):
        problems.append(f"{_where(file, prefix + key)} is {short_repr(value)}; only null or 'FP8' is supported")
    return value if value in (None, "FP8") else None


def _parse_nested(obj: dict, problems: list[str]) -> _Parsed:
    file = "hf_quant_config.json"
    _unknown(obj, _NESTED_TOP, file, "", problems)
    parsed = _Parsed(NESTED, producer=_producer(obj, file, "", problems))
    quant = obj["quantization"]
    if not isinstance(quant, dict):
        problems.append(f"{_where(file, 'quantization')} must be an object, got {short_repr(quant)}")
        return parsed
    _unknown(quant, _NESTED_QUANT, file, "quantization.", problems)
    _expect(quant, "quant_algo", "FP8", file, "quantization.", problems)
    parsed.kv = _kv_algo(quant, "kv_cache_quant_algo", file, "quantization.", problems)
    parsed.ignore = _patterns(quant, "exclude_modules", file, "quantization.", problems)
    return parsed


def _parse_flat(obj: dict, problems: list[str]) -> _Parsed:
    file = "hf_quant_config.json"
    _unknown(obj, _FLAT, file, "", problems)
    _expect(obj, "quant_method", "modelopt", file, "", problems)
    _expect(obj, "quant_algo", "FP8", file, "", problems)
    parsed = _Parsed(FLAT, producer=_producer(obj, file, "", problems))
    parsed.kv = _kv_algo(obj, "kv_cache_quant_algo", file, "", problems)
    lists = [p for k in ("exclude_modules", "ignore") if (p := _patterns(obj, k, file, "", problems)) is not None]
    if len(lists) == 2 and set(lists[0]) != set(lists[1]):
        problems.append(f"{file}: fields `exclude_modules` and `ignore` disagree: {lists[0]} vs {lists[1]}")
    parsed.ignore = lists[0] if lists else None
    return parsed


def _check_scheme(raw: object, file: str, prefix: str, problems: list[str]) -> None:
    """A weights/input_activations/kv_cache_scheme block: static 8-bit float, per tensor."""
    if not isinstance(raw, dict):
        problems.append(f"{_where(file, prefix.rstrip('.'))} must be an object, got {short_repr(raw)}")
        return
    _unknown(raw, _SCHEME, file, prefix, problems)
    _expect(raw, "num_bits", 8, file, prefix, problems)
    _expect(raw, "type", "float", file, prefix, problems)
    _expect(raw, "dynamic", False, file, prefix, problems)
    if "strategy" in raw:
        _expect(raw, "strategy", "tensor", file, prefix, problems)


def _parse_config_json(obj: dict, problems: list[str]) -> _Parsed:
    file, pre = "config.json", "quantization_config."
    _unknown(obj, _CONFIG, file, pre, problems)
    _expect(obj, "quant_method", "modelopt", file, pre, problems)
    _expect(obj, "quant_algo", "FP8", file, pre, problems)
    parsed = _Parsed(
        CONFIG_JSON,
        producer=_producer(obj, file, pre, problems),
        ignore=_patterns(obj, "ignore", file, pre, problems),
        kv=None,
    )
    groups = obj.get("config_groups", {})
    if not isinstance(groups, dict):
        problems.append(f"{_where(file, pre + 'config_groups')} must be an object, got {short_repr(groups)}")
        groups = {}
    for gname, group in sorted(groups.items()):
        gpre = f"{pre}config_groups.{gname}."
        if not isinstance(group, dict):
            problems.append(f"{_where(file, gpre.rstrip('.'))} must be an object, got {short_repr(group)}")
            continue
        _unknown(group, _GROUP, file, gpre, problems)
        for block in ("weights", "input_activations"):
            if block not in group:  # no input_activations would mean weight-only: not W8A8
                problems.append(f"{_where(file, gpre + block)} is missing")
            else:
                _check_scheme(group[block], file, gpre + block + ".", problems)
    if "kv_cache_scheme" in obj:
        _check_scheme(obj["kv_cache_scheme"], file, pre + "kv_cache_scheme.", problems)
        parsed.kv = "FP8"
    runtime = obj.get("runtime")
    if runtime is not None:
        if not isinstance(runtime, dict):
            problems.append(f"{_where(file, pre + 'runtime')} must be an object, got {short_repr(runtime)}")
        else:
            _unknown(runtime, {"diffusion_step_policy"}, file, pre + "runtime.", problems)
            policy = runtime.get("diffusion_step_policy")
            if policy is not None and not isinstance(policy, dict):
                problems.append(
                    f"{_where(file, pre + 'runtime.diffusion_step_policy')} must be an object, got {short_repr(policy)}"
                )
            elif policy is not None:
                found: list[str] = []  # validated here, with the rest of the config: before any model is built
                check_step_policy(policy, found)
                problems.extend(f"{file}: quantization_config.runtime.{p}" for p in found)
                parsed.step_policy = policy
    return parsed


def _agree(parsed: list[_Parsed], problems: list[str]) -> None:
    for a, b in zip(parsed, parsed[1:]):
        for field, va, vb in (
            ("ignore/exclude_modules", a.ignore, b.ignore),
            ("kv cache algorithm", a.kv, b.kv),
            ("producer", a.producer, b.producer),
        ):
            unspecified = (None, ...) if field != "kv cache algorithm" else (...,)
            if va in unspecified or vb in unspecified:
                continue
            same = set(va) == set(vb) if field.startswith("ignore") else va == vb
            if not same:
                problems.append(
                    f"{a.spelling} and {b.spelling} disagree on {field}: {short_repr(va)} vs {short_repr(vb)}"
                )


def read_quant_config(directory: Path, config: dict, problems: list[str]) -> QuantConfig:
    """The checkpoint's quantization config; every problem with it goes to ``problems``.

    ``config`` is the already-parsed config.json (``{}`` when absent). With a problem the
    result is ``PLAIN`` (and the caller raises).
    """
    hf_path = Path(directory) / "hf_quant_config.json"
    obj = read_json_file(hf_path, "hf_quant_config.json", problems) if present(hf_path) else None
    return parse_quant_config(obj, config, problems)


def parse_quant_config(obj: dict | None, config: dict, problems: list[str]) -> QuantConfig:
    """``read_quant_config`` on an already-read ``hf_quant_config.json`` (``obj``; None when
    absent or unreadable) and ``config.json``."""
    before = len(problems)
    parsed: list[_Parsed] = []
    if obj is not None:
        if "quantization" in obj:
            parsed.append(_parse_nested(obj, problems))
        elif "quant_method" in obj or "quant_algo" in obj:
            parsed.append(_parse_flat(obj, problems))
        else:
            problems.append(
                "hf_quant_config.json: has neither `quantization` (nested) nor "
                "`quant_method`/`quant_algo` (flat); cannot tell what it describes"
            )
    if "quantization_config" in config:
        raw = config["quantization_config"]
        if isinstance(raw, dict):
            parsed.append(_parse_config_json(raw, problems))
        else:
            problems.append(f"config.json: field `quantization_config` must be an object, got {short_repr(raw)}")
    if len(problems) > before or not parsed:
        return PLAIN
    _agree(parsed, problems)
    first = lambda attr, skip: next((getattr(p, attr) for p in parsed if getattr(p, attr) not in skip), None)
    kv = first("kv", (...,))
    return QuantConfig(
        is_modelopt_fp8=True,
        spellings=tuple(p.spelling for p in parsed),
        producer=first("producer", (None,)),
        ignore=first("ignore", (None,)) or (),
        kv_cache_quant_algo=kv,
        step_policy=first("step_policy", (None,)),
    )
