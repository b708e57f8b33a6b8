"""Session-wide test set-up: one intra-op thread per process, and pytest-timeout's per-test hang
guard scaled to the machine.

Every process of the suite (the xdist workers, the ranks they fork, the jobs they start) computes
on one intra-op thread, as a torchrun rank does (torchrun sets ``OMP_NUM_THREADS=1``): on two cores
two workers each running 2-4 ranks at torch's default of one thread per core oversubscribe the
machine, and the suite then ran 616 s instead of 466 s (one quiet run each). An ``OMP_NUM_THREADS``
already set is kept. The tests whose subject is the thread count set it themselves
(tests/unit/test_decode_threads.py, test_ulysses_attention.py).

The ``timeout`` in pyproject.toml (and each ``@pytest.mark.timeout``) is a reference-machine
figure; each test's guard is that times ``calibration.slowdown()`` measured as the test starts,
so a busy machine slows the suite down instead of failing it. The guard still fires: a test
that hangs is stopped after the scaled time, and the report says the factor used.
"""

from __future__ import annotations

import os

import calibration
import pytest

# Read by torch when it is first imported (after this: no plugin of the suite imports it), and
# inherited by the xdist workers this process starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Arm pytest-timeout's own timer with the scaled timeout (firstresult: it then skips)."""
    import pytest_timeout

    factor = calibration.slowdown()
    item.user_properties.append(("timeout_slowdown", round(factor, 2)))
    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=settings.timeout * factor))


def pytest_report_header(config):
    return f"slowdown factor for hang guards and timed bounds: {calibration.slowdown():.2f} (tests/calibration.py)"


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory):
    """The demo pipeline's root, built once for the whole run in one ``FSDP_FP8_CACHE`` shared by
    the xdist workers (their base directories have one parent; ``build_once`` locks the build, as
    for concurrent launchers). Read it, never change it: a test that edits a pipeline copies it."""
    pytest.importorskip("diffusers")
    from fsdp_fp8.generation.demo import demo_checkpoint

    base = tmp_path_factory.getbasetemp()
    return demo_checkpoint((base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "shared-demo-cache")


@pytest.fixture(scope="session")
def demo_cache(demo_root):
    """The ``FSDP_FP8_CACHE`` that holds ``demo_root`` (``<cache>/cosmos3-demo-<version>``)."""
    return demo_root.parent


@pytest.fixture(scope="session")
def action_root(demo_cache) -> str:
    """The action-capable demo root (``action_demo_checkpoint``), built once beside the demo."""
    from fsdp_fp8.generation.demo import action_demo_checkpoint

    return str(action_demo_checkpoint(demo_cache))


@pytest.fixture(scope="session")
def distilled_root(demo_cache) -> str:
    """The distilled 4-step demo root (``distilled_checkpoint``), built once beside the demo."""
    from fsdp_fp8.generation.demo import distilled_checkpoint

    return str(distilled_checkpoint(demo_cache))


@pytest.fixture(scope="session")
def mot_root(tmp_path_factory) -> str:
    """The reference MoT's static-FP8 checkpoint (``write_mot_checkpoint``: 6 s of export and
    calibration), built once for the whole run beside the shared demo cache, under its lock. Read
    it, never change it."""
    from fsdp_fp8.export.cache import build_once
    from fsdp_fp8.testing.mot_checkpoint import write_mot_checkpoint

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "shared-demo-cache"
    return str(build_once(shared / "mot-checkpoint", write_mot_checkpoint, lambda target: target.is_dir()))


@pytest.fixture(scope="module")
def roots(tmp_path_factory, demo_root):
    """The demo's root and a pipeline of the real ModelOpt Cosmos 3 fixture beside the demo's VAE
    (``pipelines.pipeline_beside_the_demo``), as strings; one per module."""
    from pipelines import pipeline_beside_the_demo

    return str(demo_root), pipeline_beside_the_demo(demo_root, tmp_path_factory.mktemp("fixture") / "root")


@pytest.fixture
def fake_rank(monkeypatch):
    """``fake_rank(rank, world)``: the fake process group for that rank, torn down after the test."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # fully_shard's device lookup only

    def start(rank: int, world: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cuda", (world,))

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
