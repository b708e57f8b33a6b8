"""The diffusion step policy: which denoising steps run the generation tower W8A16.

A checkpoint may publish ``config.json["quantization_config"]["runtime"]["diffusion_step_policy"]``
(docs/step-policy.md). It is read fail-closed: every field is required,
every value is checked, unknown fields are refused, and all problems are reported at once.
The policy itself is a pure function of ``(step, num_steps)`` so that the two
classifier-free-guidance passes of one step can never disagree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from fsdp_fp8.errors import ArgumentError, raise_if_problems

logger = logging.getLogger(__name__)

Precision = Literal["a16", "native"]

_PREFIX = "diffusion_step_policy"
_PRECISIONS = ("a16", "native")
_LABELS = {"a16": "W8A16", "native": "W8A8"}

# The policy as published by the checkpoint producer (docs/step-policy.md).
PUBLISHED_POLICY: dict[str, Any] = {
    "schema_version": 1,
    "type": "first_last_n",
    "index_space": "denoising_loop_iteration",
    "scope": ["transformer"],
    "default_mode": "native",
    "first_steps": {"count": 3, "mode": "a16"},
    "last_steps": {"count": 3, "mode": "a16"},
    "overlap": "a16",
    "reasoner": "a16",
}

_TOP_FIELDS = frozenset(PUBLISHED_POLICY)
_WINDOW_FIELDS = frozenset(("count", "mode"))


@dataclass(frozen=True)
class StepPolicy:
    """A validated ``first_last_n`` policy; build it with :func:`parse_step_policy`."""

    first_count: int
    last_count: int
    overlap: Precision
    reasoner: Precision

    def precision(self, step: int, num_steps: int) -> Precision:
        """Precision of the generation tower at denoising step ``step`` of ``num_steps``."""
        if not _is_int(num_steps) or num_steps < 1:
            raise ArgumentError(f"num_steps must be an int >= 1, got {num_steps!r}", "step policy")
        if not _is_int(step) or not 0 <= step < num_steps:
            raise ArgumentError(f"step must be an int in [0, {num_steps}), got {step!r}", "step policy")
        if num_steps == 1:  # a one-step request stays native (docs/step-policy.md)
            return "native"
        in_first = step < self.first_count
        in_last = step >= num_steps - self.last_count
        if in_first and in_last:
            return self.overlap
        return "a16" if in_first or in_last else "native"

    @property
    def reasoner_precision(self) -> Precision:
        """Precision of the understanding tower; stated outright, not derived from a step."""
        return self.reasoner


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `"count": true` is a malformed policy, not a count of 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(obj: dict, required: frozenset[str], where: str, problems: list[str]) -> None:
    for name in sorted(required - obj.keys()):
        problems.append(f"`{where}.{name}` is required but missing")
    for name in sorted(obj.keys() - required, key=str):
        problems.append(f"`{where}.{name}` is not a known field")


def _check_equal(obj: dict, name: str, expected: Any, where: str, problems: list[str]) -> None:
    if name not in obj:
        return
    value = obj[name]
    if type(value) is not type(expected) or value != expected:
        problems.append(f"`{where}.{name}` must be {expected!r}, got {value!r}")


def _check_precision(obj: dict, name: str, where: str, problems: list[str]) -> None:
    if name in obj and (not isinstance(obj[name], str) or obj[name] not in _PRECISIONS):
        problems.append(f"`{where}.{name}` must be one of {list(_PRECISIONS)}, got {obj[name]!r}")


def _check_window(obj: dict, name: str, where: str, problems: list[str]) -> None:
    if name not in obj:
        return
    window = obj[name]
    here = f"{where}.{name}"
    if not isinstance(window, dict):
        problems.append(f"`{here}` must be an object with `count` and `mode`, got {window!r}")
        return
    _check_fields(window, _WINDOW_FIELDS, here, problems)
    if "count" in window:
        count = window["count"]
        if not _is_int(count) or count < 0:
            problems.append(f"`{here}.count` must be a non-negative integer, got {count!r}")
    _check_equal(window, "mode", "a16", here, problems)


def check_step_policy(raw: Any, problems: list[str]) -> None:
    """Add every problem of a raw ``diffusion_step_policy`` object to ``problems``."""
    where = _PREFIX
    if not isinstance(raw, dict):
        problems.append(f"`{where}` must be an object, got {raw!r}")
        return
    _check_fields(raw, _TOP_FIELDS, where, problems)
    _check_equal(raw, "schema_version", 1, where, problems)
    _check_equal(raw, "type", "first_last_n", where, problems)
    _check_equal(raw, "index_space", "denoising_loop_iteration", where, problems)
    _check_equal(raw, "default_mode", "native", where, problems)
    if "scope" in raw:
        scope = raw["scope"]
        if not isinstance(scope, list) or not scope:
            problems.append(f"`{where}.scope` must be a non-empty list, got {scope!r}")
        else:
            for i, entry in enumerate(scope):
                if not isinstance(entry, str) or entry != "transformer":
                    problems.append(f"`{where}.scope[{i}]` must be 'transformer', got {entry!r}")
    _check_window(raw, "first_steps", where, problems)
    _check_window(raw, "last_steps", where, problems)
    _check_precision(raw, "overlap", where, problems)
    _check_precision(raw, "reasoner", where, problems)


def parse_step_policy(raw: Any, source: str = "config.json") -> StepPolicy:
    """Validate a raw ``diffusion_step_policy`` object; raise CheckpointError listing every problem."""
    problems: list[str] = []
    check_step_policy(raw, problems)
    raise_if_problems(problems, source)
    return StepPolicy(
        first_count=raw["first_steps"]["count"],
        last_count=raw["last_steps"]["count"],
        overlap=raw["overlap"],
        reasoner=raw["reasoner"],
    )


def resolve_step_policy(
    checkpoint_raw: dict | None, override: str | dict = "auto", source: str = "config.json"
) -> StepPolicy | None:
    """The policy to run with: the checkpoint's (``"auto"``), none (``"off"``) or the user's own.

    ``checkpoint_raw`` is the checkpoint's raw ``diffusion_step_policy`` or ``None``. Under
    ``"auto"`` a checkpoint without a policy runs fully W8A8: the library adds none of its own.
    The checkpoint's policy is validated whenever it is present, even if overridden, so a
    malformed checkpoint never passes silently.
    """
    published = None if checkpoint_raw is None else parse_step_policy(checkpoint_raw, source)
    if isinstance(override, dict):
        policy = parse_step_policy(override, "step policy override")
        logger.warning(
            "using the step policy override %s instead of %s",
            describe_policy(policy),
            "the checkpoint's " + describe_policy(published) if published else "none (checkpoint has none)",
        )
        return policy
    if override == "off":
        if published is not None:
            logger.warning(
                "the checkpoint's diffusion step policy (%s) is disabled by override 'off'; every step runs W8A8",
                describe_policy(published),
            )
        return None
    if override == "auto":
        if published is not None:
            logger.info("using the checkpoint's diffusion step policy: %s", describe_policy(published))
        return published
    raise ArgumentError(f"step policy override must be 'auto', 'off' or a dict, got {override!r}", "step policy")


def describe_policy(policy: StepPolicy) -> str:
    """The policy in a user's words: ``W8A16 steps 0-2 and the last 3 (W8A8 between), reasoner W8A16``."""
    windows = []
    if policy.first_count:
        windows.append("step 0" if policy.first_count == 1 else f"steps 0-{policy.first_count - 1}")
    if policy.last_count:
        windows.append("the last step" if policy.last_count == 1 else f"the last {policy.last_count}")
    rest = {2: "between", 1: "after" if policy.first_count else "before"}.get(len(windows))
    text = f"W8A16 {' and '.join(windows)} (W8A8 {rest})" if windows else "W8A8 every step"
    if len(windows) == 2 and policy.overlap != "a16":
        text += f", {_LABELS[policy.overlap]} where the two overlap"
    return f"{text}, reasoner {_LABELS[policy.reasoner]}"


def describe_trace(precisions: list[str]) -> str:
    """Run-length summary of per-step precisions: ``"W8A16 x3 / W8A8 x44 / W8A16 x3"``.

    ``precisions`` in the policy's words (``"a16"``, ``"native"``) or the launcher's (``"W8A16"``,
    ``"W8A8"``, what ``PrecisionRouting.trace`` holds)."""
    runs: list[list] = []
    for p in precisions:
        p = {label: word for word, label in _LABELS.items()}.get(p, p)
        if p not in _LABELS:
            known = list(_LABELS.values()) + list(_LABELS)
            raise ArgumentError(f"unknown precision {p!r}; expected one of {known}", "step policy")
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return " / ".join(f"{_LABELS[p]} x{n}" for p, n in runs)
