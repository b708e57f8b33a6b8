"""The FP8 NaN-code check: E4M3 bytes with the NaN pattern S.1111.111 (0x7F / 0xFF).

ModelOpt saturates to +-448 and never writes these codes, so a weight holding one is not what
was calibrated. The loader runs the check on the bytes it read, on the rank that read them:
on host storage inside the reader's workers as each request lands (``CodeCheck``, overlapping
the other workers' reads), and on accelerator storage after the staging ring's copies
(``nan_code_problems``, one sync for all of them).
"""

from __future__ import annotations

import threading
import time

import torch


def nan_code_flag(codes: torch.Tensor) -> torch.Tensor:
    """0-d bool on ``codes``' device: does any E4M3 code have the NaN pattern S.1111.111?

    0x7F is the largest int8 and 0xFF the largest uint8, so two max-reductions over the bytes,
    with no temporary, find both patterns: a few percent of the read, on the same memory.
    """
    u8 = codes.reshape(-1).view(torch.uint8)
    if u8.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=codes.device)
    return (u8.amax() == 0xFF) | (u8.view(torch.int8).amax() == 0x7F)


def nan_code_count(codes: torch.Tensor) -> int:
    """How many E4M3 codes have a NaN pattern (0x7F / 0xFF); one flag check first, so the usual
    answer (none) costs the two max-reductions alone."""
    if not bool(nan_code_flag(codes)):
        return 0
    return int(((codes.reshape(-1).view(torch.uint8) & 0x7F) == 0x7F).sum())


def nan_code_problem(entry, count: int) -> str:
    """The problem line for ``count`` NaN codes in the tensor ``entry`` names (key and file)."""
    return (
        f"`{entry.key}` in {entry.file} holds {count} FP8 codes that are NaN in E4M3 (0x7F / 0xFF); "
        "ModelOpt saturates to +-448 and never writes them"
    )


class CodeCheck:
    """The check of the bytes read into host storage, run by the reader's workers on each
    request as it lands (``read_schedule.run(after_read=...)``): it overlaps the other workers'
    reads instead of adding a pass over every weight after the last read."""

    def __init__(self, fp8_entries):
        self.entries = {e.key: e for e in fp8_entries}
        self.counts: dict[str, int] = {}
        self.seconds = 0.0  # summed over the workers
        self._lock = threading.Lock()

    def __call__(self, request, buffers) -> None:
        t0 = time.perf_counter()
        found = {}
        for piece, buf in zip(request.pieces, buffers):
            if piece.entry.key in self.entries:
                found[piece.entry.key] = found.get(piece.entry.key, 0) + nan_code_count(
                    torch.frombuffer(buf, dtype=torch.uint8)
                )
        with self._lock:
            for key, n in found.items():
                self.counts[key] = self.counts.get(key, 0) + n
            self.seconds += time.perf_counter() - t0

    def problems(self) -> list[str]:
        return [nan_code_problem(self.entries[k], n) for k, n in sorted(self.counts.items()) if n]


def nan_code_problems(checks: list[tuple]) -> list[str]:
    """The check of codes on the device that holds them: (entry, codes) pairs, one sync for all."""
    if not checks or checks[0][1].is_meta:  # (meta: no bytes to check; tests stand in a meta model)
        return []
    flags = [nan_code_flag(codes) for _, codes in checks]
    if not bool(torch.stack(flags).any()):
        return []
    return [nan_code_problem(entry, nan_code_count(codes)) for (entry, codes), flag in zip(checks, flags) if flag]
