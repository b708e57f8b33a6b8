"""One activation quantization per shared input: q/k/v of one attention, gate/up of one MLP.

Siblings that read the same tensor carry identical ``input_scale``s in real ModelOpt
exports, so the E4M3 activation they would each compute is the same: quantize once and
hand the same tensor to every GEMM. The scales are compared here, once, at load time
(reading a scale in forward would sync the device); a group whose scales differ keeps
per-projection quantization and is named in a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_fp8.fp8.linear import Float8StaticLinear, SharedActivation

log = logging.getLogger(__name__)

SIBLING_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("to_q", "to_k", "to_v"),
    ("add_q_proj", "add_k_proj", "add_v_proj"),
    ("gate_proj", "up_proj"),
)


def _input_scale(linear: Float8StaticLinear) -> torch.Tensor:
    weight = linear.weight
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    return local.act_quant_scale


def share_quantized_inputs(model: nn.Module) -> tuple[list[str], list[str]]:
    """Group sibling FP8 linears; returns (shared group names, groups left per-projection)."""
    shared, separate = [], []
    for parent_name, parent in model.named_modules():
        for names in SIBLING_GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, Float8StaticLinear) for m in members):
                continue
            group = f"{parent_name}.{{{','.join(names)}}}" if parent_name else "{" + ",".join(names) + "}"
            scales = [_input_scale(m) for m in members]
            if all(torch.equal(scales[0], s) for s in scales[1:]):
                activation = SharedActivation(len(members))
                for m in members:
                    m.shared = activation
                shared.append(group)
            else:
                values = ", ".join(f"{n}={s.item():.6g}" for n, s in zip(names, scales))
                log.warning("%s: input scales differ (%s); each projection quantizes its own input", group, values)
                separate.append(group)
    return shared, separate
