"""Prefetch (off by default): while the model is set up, a background thread hints the rows this
rank will read to the page cache (``POSIX_FADV_WILLNEED``), at most the budget, and is joined
before the first read; ``inspect`` reports the budget and what each rank would prefetch."""

from __future__ import annotations

import pytest
from calibration import bound
from ranks import run_ranks

from fsdp_fp8.cli import commands as cli
from fsdp_fp8.models import MoTConfig
from fsdp_fp8.reading import prefetch
from fsdp_fp8.reading.read_options import ReadOptions
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint

CONFIG = MoTConfig(
    hidden_size=96, num_layers=2, num_heads=4, head_dim=24, intermediate_size=136, vocab_size=301, latent_channels=6
)
SMALL_BUDGET = 50_000  # bytes: less than a rank reads


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_sparse_checkpoint(
        CONFIG, tmp_path_factory.mktemp("prefetch") / "ckpt", fill="random", max_shard_size=150_000
    )


def _merged(ranges) -> list[tuple[str, int, int]]:
    out: list[list] = []
    for name, offset, n in sorted(ranges):
        if out and out[-1][0] == name and out[-1][1] + out[-1][2] == offset:
            out[-1][2] += n
        else:
            out.append([name, offset, n])
    return [tuple(r) for r in out]


def _load(rank: int, world: int, path: str) -> dict:
    import os
    import time

    from fsdp_fp8 import load_model
    from fsdp_fp8.interop.architectures import resolve_model_spec
    from fsdp_fp8.reading import prefetch, read_schedule

    events: list[tuple[str, float, tuple]] = []
    real_advise, real_read = os.posix_fadvise, read_schedule.read_request
    default = ReadOptions().prefetch_bytes  # what a user gets without setting anything

    slow = [0.0]

    def advise(fd, offset, n, how):
        assert how == os.POSIX_FADV_WILLNEED
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        real_advise(fd, offset, n, how)
        time.sleep(slow[0])
        events.append(("hint", time.monotonic(), (name, offset, n)))  # when the hint returned

    def read(request, buffers, **kw):  # (kw: an O_DIRECT read's bounce buffer)
        events.append(("read", time.monotonic(), (request.pieces[0].entry.file, request.offset, request.nbytes)))
        return real_read(request, buffers, **kw)

    real_stop = prefetch.Prefetch.stop

    def stop_when_done(self):  # the set-up outlasts every hint here; on a starved machine it may not
        if self._thread.is_alive():
            self._thread.join()
        return real_stop(self)

    read_schedule.os.posix_fadvise, read_schedule.read_request = advise, read
    prefetch.Prefetch.stop = stop_when_done  # which rows are hinted, not how far a busy set-up lets them get
    out = {}
    try:
        for budget in ("default", 1 << 40, SMALL_BUDGET, 0, "slow"):
            if budget == "slow":  # hints slower than the set-up: stopped part-way, and joined
                # Hints slowed with the machine: a busy set-up must not outlast all of them.
                slow[0], prefetch.PREFETCH_CALL_BYTES = bound(0.05), 1000
                prefetch.Prefetch.stop = real_stop
            # (page-cache reads: the hints are for them; an O_DIRECT load hints nothing, test_direct_reads)
            budget_bytes = {"slow": 1 << 40, "default": default}.get(budget, budget)
            options = ReadOptions(direct=False, prefetch_bytes=budget_bytes)
            events.clear()
            loaded = load_model(resolve_model_spec(CONFIG.to_config_dict()).model_fn, path, read_options=options)
            hints = [e for e in events if e[0] == "hint"]
            reads = [e for e in events if e[0] == "read"]
            out[budget] = {
                "hints": [e[2] for e in hints],
                "reads": [e[2] for e in reads],
                "hinted_before_reads": not hints or max(e[1] for e in hints) < min(e[1] for e in reads),
                "prefetch_bytes": loaded.report.prefetch_bytes,
                "bytes_read": loaded.report.bytes_read,
            }
    finally:
        read_schedule.os.posix_fadvise, read_schedule.read_request = real_advise, real_read
        prefetch.Prefetch.stop = real_stop
    return out


def test_prefetch_hints_exactly_this_ranks_rows_before_reading_them(checkpoint_dir):
    for r in run_ranks(_load, 2, str(checkpoint_dir), timeout=180):
        everything, small, off = r[1 << 40], r[SMALL_BUDGET], r[0]
        assert r["default"]["prefetch_bytes"] == r["default"]["bytes_read"] > 0  # on by default: every row
        assert everything["hints"] and everything["hinted_before_reads"]
        assert _merged(everything["hints"]) == _merged(everything["reads"])  # the rows it then read, all
        assert everything["prefetch_bytes"] == everything["bytes_read"]
        # A budget below the rank's reads: exactly that many bytes, the first in file order.
        assert small["prefetch_bytes"] == sum(n for _, _, n in small["hints"]) == SMALL_BUDGET
        first = _merged(small["hints"])
        assert first[0][:2] == _merged(small["reads"])[0][:2]
        assert off["hints"] == [] and off["prefetch_bytes"] == 0 and off["bytes_read"] == everything["bytes_read"]
        slow = r["slow"]  # stopped when the set-up ended; no hint still running once reads began
        assert 0 < slow["prefetch_bytes"] == sum(n for _, _, n in slow["hints"]) < slow["bytes_read"]
        assert slow["hinted_before_reads"]


def test_the_budget_is_capped_at_the_ranks_share_of_half_the_available_memory(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 ranks hint into this node's page cache
    monkeypatch.setattr(prefetch, "available_memory", lambda: 10_000)
    assert prefetch.prefetch_budget(1 << 40) == 1_250
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(prefetch, "available_memory", lambda: 10_000)
    assert prefetch.prefetch_budget(1 << 40) == 5_000
    assert prefetch.prefetch_budget(3_000) == 3_000
    monkeypatch.setattr(prefetch, "available_memory", lambda: None)
    assert prefetch.prefetch_budget(1 << 40) == 1 << 40


def test_inspect_reports_the_prefetch_budget_and_each_ranks_share(checkpoint_dir, capsys, monkeypatch):
    monkeypatch.setattr(prefetch, "available_memory", lambda: 1 << 40)
    inspect = ["inspect", str(checkpoint_dir), "--world-size", "3"]
    assert cli.main([*inspect, "--prefetch-bytes", str(SMALL_BUDGET)]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # the report wraps its long lines
    assert (
        f"prefetch: page-cache hints during the set-up, at most {SMALL_BUDGET:,} bytes (0.05 MiB) per rank (the budget)"
        in words
    )
    assert out.count(f"prefetch {SMALL_BUDGET:,} bytes") == 3  # every rank reads more than the budget
    assert cli.main([*inspect, "--prefetch-bytes", "0"]) == 0
    assert capsys.readouterr().out.count("prefetch 0 bytes") == 3
    assert cli.main(inspect) == 0  # the default: ALL_ROWS
    out = capsys.readouterr().out
    assert "per rank (every row it reads)" in " ".join(out.split()) and "prefetch 0 bytes" not in out
