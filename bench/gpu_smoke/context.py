"""What every section shares: the results file (JSON lines, appended and synced per record) and
the ``Context`` a section runs in (its device and mode, where its records go, one ``try`` per
variant, timing with the device synced)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from bench import harness

# Lines that mean a rank was killed or a collective timed out, even when the exit code is 0.
BAD_LINES = re.compile(
    r"watchdog|terminate called|Terminating process|SIGTERM|SIGABRT|"
    r"destroy_process_group\(\) was not called",
    re.IGNORECASE,
)


class Results:
    """Append-only JSON lines, flushed and synced per record: a kill loses nothing written."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def load_results(path: Path) -> dict:
    """``{"sections": {name: {"status", "variants": {variant: record}, ...}}, "summary": ...}``."""
    out: dict = {"sections": {}, "summary": None}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line of a process killed while writing it
            out["unreadable_lines"] = out.get("unreadable_lines", 0) + 1
            continue
        if record.get("section") == "summary":
            out["summary"] = record
            continue
        section = out["sections"].setdefault(record["section"], {"variants": {}})
        if record.get("variant") is None:
            section.update(record)
        else:
            section["variants"][record["variant"]] = record
    return out


@dataclass
class Context:
    """What a section needs: its device and mode, and where its records go."""

    section: str
    device: object  # torch.device
    dry: bool
    fake: bool
    quick: bool
    emit: object  # callable(record)
    args: argparse.Namespace | None = None
    records: list = field(default_factory=list)

    def record(self, variant: str, status: str, **figures) -> None:
        rec = {"section": self.section, "variant": variant, "status": status, **figures}
        self.records.append(rec)
        self.emit(rec)

    def skip(self, variant: str, reason: str) -> None:
        self.record(variant, "skipped", reason=reason)

    @contextlib.contextmanager
    def variant(self, name: str):
        """One variant in its own try: a failure is recorded and the section goes on."""
        figures: dict = {}
        t0 = time.perf_counter()
        try:
            yield figures
        except Exception as exc:  # noqa: BLE001 - recorded; the next variant still runs
            self.record(
                name,
                "failed",
                error=f"{type(exc).__name__}: {exc}"[:2000],
                traceback=traceback.format_exc()[-3000:],
                seconds=round(time.perf_counter() - t0, 3),
                **figures,
            )
        else:
            status = figures.pop("status", "ok")
            self.record(name, status, seconds=round(time.perf_counter() - t0, 3), **figures)

    def place(self, t):
        """A CPU tensor on this context's device (a fake of the same layout under fake CUDA)."""
        if self.fake:
            from bench.gpu_smoke.fake_cuda import placed

            return placed(t, self.device)
        return t.to(self.device)

    def sync(self) -> None:
        if self.device.type == "cuda" and not self.fake:
            import torch

            torch.cuda.synchronize(self.device)

    def timed(self, fn, reps: int) -> list[float]:
        """Seconds of ``reps`` calls of ``fn`` after one untimed call (warm-up, any compilation),
        the device synced before and after each."""
        fn()
        return harness.sample_seconds(fn, reps, before=self.sync, after=self.sync)
