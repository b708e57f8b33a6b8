"""After a load, before the first forward: the one recipe both the launcher and ``load_pipeline`` run."""

from __future__ import annotations

from fsdp_fp8.format.step_policy import resolve_step_policy
from fsdp_fp8.fp8.shared_inputs import share_quantized_inputs
from fsdp_fp8.load.loaded import LoadedModel
from fsdp_fp8.runtime.precision import PrecisionRouting, install_step_policy


def prepare_for_inference(loaded: LoadedModel, step_policy: str | dict = "auto") -> PrecisionRouting:
    """Make ``loaded.model`` ready to run: the step policy (``"auto"``: the checkpoint's; ``"off"``:
    every step W8A8; or a policy dict) routed over its towers (``loaded.towers``), and one
    activation quantization per input its sibling FP8 linears share (q/k/v, gate/up). Returns
    the routing (``fsdp_fp8.routing_of(loaded.model)`` afterwards)."""
    source = f"{loaded.checkpoint.directory}/config.json"
    policy = resolve_step_policy(loaded.checkpoint.quant.step_policy, step_policy, source)
    routing = install_step_policy(loaded.model, policy, loaded.towers)
    share_quantized_inputs(loaded.model)
    return routing
