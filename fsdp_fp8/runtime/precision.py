"""Per-step precision: route each FP8 linear to W8A8 or W8A16 as the step policy says.

The generation (denoising) tower follows the checkpoint's step policy, step by step; the
understanding ("reasoner") tower runs once per request and takes the policy's
``reasoner`` precision outright. The selector is a plain Python attribute on each linear,
so choosing it costs no device sync and ``torch.compile`` guards on it like any constant.
The choice is a pure function of ``(step, num_steps)``: both classifier-free-guidance
passes of one step, and every rank, agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from fsdp_fp8.fp8.linear import Float8StaticLinear
from fsdp_fp8.format.step_policy import StepPolicy

GENERATION, REASONER = "generation", "reasoner"


@dataclass
class PrecisionRouting:
    policy: StepPolicy | None
    generation: list[Float8StaticLinear] = field(default_factory=list)
    reasoner: list[Float8StaticLinear] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)  # the generation tower's precision per step run


def install_step_policy(
    model: nn.Module, policy: StepPolicy | None, towers: dict[str, str] | None = None
) -> PrecisionRouting:
    """Attach the routing to ``model``; ``towers`` maps linear names to a tower.

    Without ``towers`` every FP8 linear belongs to the generation tower (a plain diffusion
    transformer). Linears in any other tower ("other") are never touched.
    """
    routing = PrecisionRouting(policy)
    for name, module in model.named_modules():
        if not isinstance(module, Float8StaticLinear):
            continue
        tower = towers.get(name, "other") if towers is not None else GENERATION
        if tower == GENERATION:
            routing.generation.append(module)
        elif tower == REASONER:
            routing.reasoner.append(module)
    reasoner_mode = policy.reasoner_precision if policy is not None else "native"
    for module in routing.reasoner:
        module.mode = reasoner_mode
    model.fsdp_fp8_precision = routing
    return routing


def routing_of(model: nn.Module) -> PrecisionRouting:
    routing = getattr(model, "fsdp_fp8_precision", None)
    if routing is None:
        raise RuntimeError("no step policy installed on this model: call install_step_policy first")
    return routing


@contextlib.contextmanager
def denoising_step(model: nn.Module, step: int, num_steps: int) -> Iterator[str]:
    """Run the generation tower at step ``step`` of ``num_steps``'s precision; yields it."""
    routing = routing_of(model)
    precision = routing.policy.precision(step, num_steps) if routing.policy is not None else "native"
    for module in routing.generation:
        module.mode = precision
    routing.trace.append(precision)
    try:
        yield precision
    finally:
        for module in routing.generation:
            module.mode = "native"
