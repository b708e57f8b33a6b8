"""Per-step precision: route each FP8 linear to W8A8 or W8A16 as the step policy says.

The generation tower follows the checkpoint's step policy; the reasoner tower takes the policy's
``reasoner`` precision outright; other linears are never switched. A tower map says which linear
is which (``fsdp_fp8.runtime.towers``). :func:`denoising_step` sets step ``(i, n)``'s mode; the
choice is a pure function of ``(i, n)``, so both guidance passes and every rank agree.

The mode is a plain Python attribute of each linear: no device sync, and ``torch.compile`` guards
on it. Reports say ``W8A16`` / ``W8A8``; the checkpoint's words ``a16`` / ``native`` stay in the
file and in ``Float8StaticLinear.mode``.

Design: docs/step-policy.md; docs/design.md, "Forward: W8A8, W8A16 and the topology rule".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from torch import nn

from fsdp_fp8.collective.attached import Attachment
from fsdp_fp8.errors import CheckpointError, raise_if_problems
from fsdp_fp8.format.step_policy import StepPolicy, describe_trace
from fsdp_fp8.fp8.linear import Float8StaticLinear
from fsdp_fp8.runtime.towers import GENERATION, REASONER, tower_map_problems

W8A16, W8A8 = "W8A16", "W8A8"
LABELS = {"a16": W8A16, "native": W8A8}  # the policy's word -> the launcher's


@dataclass
class PrecisionRouting:
    """Which FP8 linears follow the step policy (``generation``) and which take the reasoner's
    precision (``reasoner``), and the generation tower's precision per step run (``trace``)."""

    policy: StepPolicy | None
    generation: list[Float8StaticLinear] = field(default_factory=list)
    reasoner: list[Float8StaticLinear] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)  # the generation tower's precision per step run: W8A16 / W8A8
    active: int = 0  # how many step contexts are open (a pipeline enters one per guidance pass)

    def summary(self, start: int = 0) -> str:
        """The trace from step ``start`` as the launcher prints it: ``"W8A16 x3 / W8A8 x14 / W8A16 x3"``."""
        return describe_trace(self.trace[start:])


# A model's routing, kept by ``install_step_policy`` (docs/design.md, "State kept on other
# libraries' objects"); read by ``routing_of``.
PRECISION: Attachment[PrecisionRouting] = Attachment("a model's step-policy routing")


def install_step_policy(
    model: nn.Module, policy: StepPolicy | None, towers: Mapping[str, str] | None = None
) -> PrecisionRouting:
    """Route ``model``'s FP8 linears by ``policy``; ``towers`` maps linear names to a tower. The
    routing is returned and kept for ``model`` (``routing_of``; held weakly).

    Without ``towers`` every FP8 linear belongs to the generation tower, which is exact only
    when the policy never runs the two towers differently; a policy that does (its
    ``reasoner`` differs from its steps) is refused, as is a map that leaves an FP8 linear out
    (``CheckpointError``, the load's own check: ``towers.tower_map_problems``). Linears mapped
    to "other" are never touched.
    """
    fp8 = {name: m for name, m in model.named_modules() if isinstance(m, Float8StaticLinear)}
    problems = tower_map_problems(towers, list(fp8), policy, type(model).__name__, "the step policy")
    raise_if_problems(problems, "cannot install the step policy", CheckpointError)
    routing = PrecisionRouting(policy)
    for name, module in fp8.items():
        tower = towers[name] if towers is not None else GENERATION
        if tower == GENERATION:
            routing.generation.append(module)
        elif tower == REASONER:
            routing.reasoner.append(module)
    reasoner_mode = policy.reasoner_precision if policy is not None else "native"
    for module in routing.reasoner:
        module.mode = reasoner_mode
    PRECISION.set(model, routing)
    return routing


def routing_of(model: nn.Module) -> PrecisionRouting:
    """The routing ``install_step_policy`` made for ``model`` (``load_pipeline`` installs one on
    its transformer): ``trace``, ``summary()``, the linears of each tower."""
    routing = PRECISION.get(model)
    if routing is None:
        raise RuntimeError("no step policy installed on this model: call install_step_policy first")
    return routing


@contextlib.contextmanager
def set_step_precision(routing: PrecisionRouting, step: int, num_steps: int, *, record: bool = True) -> Iterator[str]:
    """The generation tower at step ``step`` of ``num_steps``'s precision, W8A8 again on exit;
    yields ``"W8A16"`` or ``"W8A8"``.

    ``record``: append the precision to ``routing.trace`` (once per step, not per pass).
    """
    precision = routing.policy.precision(step, num_steps) if routing.policy is not None else "native"
    for module in routing.generation:
        module.mode = precision
    if record:
        routing.trace.append(LABELS[precision])
    routing.active += 1
    try:
        yield LABELS[precision]
    finally:
        routing.active -= 1
        for module in routing.generation:
            module.mode = "native"


@contextlib.contextmanager
def denoising_step(model: nn.Module, step: int, num_steps: int) -> Iterator[str]:
    """Run the generation tower at step ``step`` of ``num_steps``'s precision; yields it
    (``"W8A16"`` or ``"W8A8"``)."""
    with set_step_precision(routing_of(model), step, num_steps) as precision:
        yield precision
