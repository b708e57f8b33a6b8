"""What the benchmarks share: model sizes, the cached FP8 + BF16 checkpoints, memory sampling, the
results file. How they start processes and time them: ``bench.harness``."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from fsdp_fp8.models import MoTConfig

# ~1 GB of BF16 weights by default; "small" (~70 MB) for a quick run.
SIZES: dict[str, MoTConfig] = {
    "small": MoTConfig(
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=8000,
        latent_channels=16,
    ),
    "default": MoTConfig(
        hidden_size=1024,
        num_layers=16,
        num_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=32000,
        latent_channels=64,
    ),
}
# A typical calibrated amax(|x|) / 448 after an RMSNorm; loading and timing do not depend on it.
INPUT_SCALE = 5.0 / 448
MAX_SHARD_SIZE = 256 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
# Where every bench appends its JSON lines by default (git-ignored).
RESULTS = Path(__file__).resolve().parent / "results.jsonl"


def default_cache() -> Path:
    return Path(os.environ.get("FSDP_FP8_BENCH_DIR") or Path(tempfile.gettempdir()) / "fsdp_fp8_bench")


def _export(size: str, target: Path) -> None:
    import torch

    from fsdp_fp8.export.modelopt import DEFAULT_IGNORE, export_bf16, export_fp8
    from fsdp_fp8.format.quant_config import matches_ignore
    from fsdp_fp8.models import build_model, init_weights

    model = init_weights(build_model(SIZES[size], device="cpu"), seed=0)
    config = model.config.to_config_dict()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    scales = {n: INPUT_SCALE for n in linears if not matches_ignore(n, DEFAULT_IGNORE)}
    export_fp8(model, target / "fp8", config=config, input_scales=scales, max_shard_size=MAX_SHARD_SIZE)
    export_bf16(model, target / "bf16", config=config, max_shard_size=MAX_SHARD_SIZE)


def checkpoints(size: str, root: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(fp8_dir, bf16_dir) of the ``size`` model, exported once and cached under ``root``.

    Call it on one rank (or from every rank: a file lock serialises them).
    """
    from fsdp_fp8.export.cache import build_once

    def build(directory: Path) -> None:
        started = time.perf_counter()
        _export(size, directory)
        (directory / "done").write_text(f"{time.perf_counter() - started:.1f} s\n")

    target = build_once(Path(root or default_cache()) / f"mot-{size}", build, lambda d: (d / "done").exists())
    return target / "fp8", target / "bf16"


def checkpoint_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def drop_page_cache(directories) -> bool:
    """Evict the checkpoints' pages (POSIX_FADV_DONTNEED on clean pages needs no root).

    Targeted on purpose: ``/proc/sys/vm/drop_caches`` would flush other users' caches too.
    Returns False where the kernel kept pages or ``fincore`` cannot tell (then say warm-cache).
    """
    ok = True
    for directory in directories:
        for path in checkpoint_files(Path(directory)):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            ok = ok and _resident_pages(path) == 0
    return ok


def _resident_pages(path: Path) -> int:
    """Bytes of ``path`` in the page cache per util-linux ``fincore``; -1 when unknown."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return int(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return -1


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Peak resident set size growth over a block, per process.

    ``ru_maxrss`` alone is the process's lifetime high-water mark, so a sampling thread
    (every ``interval`` s, /proc/self/statm) covers peaks below an earlier one; the larger
    of the two estimates is kept. Run one measured block per fresh process.
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        self._maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.base = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if maxrss > self._maxrss0:  # the high-water mark rose inside the block: it is this block's
            self.peak = max(self.peak, maxrss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


def append_jsonl(path: str | os.PathLike, records) -> None:
    with open(path, "a") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True) + "\n")


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"
