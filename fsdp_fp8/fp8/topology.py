"""The static-FP8 topology rule: q/k/v and gate/up stay separate linears.

Fusing projections into one FP8 tensor needs one weight scale. When the siblings' scales
differ, every code must be re-rounded onto the largest: ``fp8(w * s_i / max(s))``, a
second rounding that changes weights the checkpoint producer calibrated. So fusing is
refused unless the scales are equal, and the refusal says how many weights would change.
"""

from __future__ import annotations

import torch

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.fp8.tensor import E4M3, E4M3_MAX


def requantize_onto(codes: torch.Tensor, scale: torch.Tensor, shared_scale: torch.Tensor) -> torch.Tensor:
    """What fusing would store: ``fp8(codes * scale / shared_scale)``."""
    return (codes.float() * (scale.float() / shared_scale.float())).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def rerounded_count(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
    """(weights whose value a shared max scale would change, total weights).

    A weight's value is ``code * scale``; onto the shared scale it becomes
    ``requantize_onto(...) * shared``. Both products are exact in float64 (a 4-bit E4M3
    mantissa times a 24-bit F32 one), so a weight counts only when its value really moves,
    not merely because its code is rescaled.
    """
    shared = max(s.float().reshape(()) for _, s in parts)
    changed = 0
    for codes, scale in parts:
        before = codes.double() * scale.double().reshape(())
        after = requantize_onto(codes, scale, shared).double() * shared.double()
        changed += int((before != after).sum())
    return changed, sum(c.numel() for c, _ in parts)


def fuse_fp8_projections(
    parts: list[tuple[torch.Tensor, torch.Tensor]], names: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate (codes, weight_scale) pairs along rows, only when that changes nothing."""
    scales = [s.float().reshape(()) for _, s in parts]
    if any(not torch.equal(scales[0], s) for s in scales[1:]):
        changed, total = rerounded_count(parts)
        listed = ", ".join(f"{n}={s.item():.6g}" for n, s in zip(names, scales))
        raise ArgumentError(
            f"refusing to fuse {names}: their weight scales differ ({listed}); one shared scale "
            f"would re-round {changed} of {total} weights ({100 * changed / total:.1f}%). "
            "Under static FP8 these projections stay separate."
        )
    return torch.cat([c for c, _ in parts]), scales[0]
