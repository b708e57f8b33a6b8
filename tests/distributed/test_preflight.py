"""Checks before loading: device facts (injected, so no GPU is needed), a process group set up
under torchrun when the caller made none, and a ``model_fn`` failure that keeps its traceback."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback

import pytest
import torch
from small_models import uneven_model_fn, write_uneven_checkpoint

from fsdp_fp8.load.preflight import DeviceFacts, device_problems


def _facts(**kw) -> DeviceFacts:
    base = dict(
        device=torch.device("cuda", 0),
        current_index=0,
        capability=(9, 0),
        visible_devices=8,
        local_rank=0,
        local_world_size=8,
        cuda_visible_devices=None,
        fp8_linears=12,
        nccl=True,
    )
    base.update(kw)
    return DeviceFacts(**base)


def test_a_good_gpu_has_no_problem():
    assert device_problems(_facts()) == []
    assert device_problems(_facts(device=torch.device("cpu"), capability=None, visible_devices=0)) == []


def test_a_gpu_below_sm89_is_refused_for_w8a8():
    (problem,) = device_problems(_facts(capability=(8, 0)))
    assert "cuda:0 has compute capability 8.0" in problem and ">= 8.9" in problem
    assert device_problems(_facts(capability=(8, 0), fp8_linears=0)) == []  # nothing runs W8A8


def test_two_ranks_on_one_gpu_are_refused():
    (problem,) = device_problems(_facts(visible_devices=4, local_rank=5))
    assert "8 ranks on this node (LOCAL_WORLD_SIZE) see 4 GPU(s)" in problem and "rank 5" in problem
    # one GPU visible and no CUDA_VISIBLE_DEVICES: every rank is on that GPU
    assert len(device_problems(_facts(visible_devices=1))) == 1
    # one GPU per rank through CUDA_VISIBLE_DEVICES: LOCAL_RANK % 1 is that rank's own GPU
    assert device_problems(_facts(visible_devices=1, cuda_visible_devices="3", device=torch.device("cuda", 0))) == []


def test_the_device_passed_must_be_the_current_one_under_nccl():
    (problem,) = device_problems(_facts(device=torch.device("cuda", 1), current_index=0))
    assert "loads onto cuda:1 but its current CUDA device is cuda:0" in problem
    assert "torch.cuda.set_device(1)" in problem
    assert device_problems(_facts(device=torch.device("cuda", 1), current_index=0, nccl=False)) == []


def test_a_device_this_process_does_not_see_is_a_problem_not_an_assertion():
    # device=cuda:LOCAL_RANK under a launcher that gives each rank one visible GPU: torch's own
    # capability query would assert on this rank alone, before the agreement.
    facts = _facts(device=torch.device("cuda", 3), capability=None, visible_devices=1, cuda_visible_devices="3")
    (problem,) = device_problems(facts)
    assert "loads onto cuda:3 but this process sees 1 GPU(s) (CUDA_VISIBLE_DEVICES=3)" in problem, problem
    assert "pass device=None" in problem


def test_every_problem_is_listed_at_once():
    found = device_problems(_facts(capability=(8, 6), visible_devices=2, device=torch.device("cuda", 1)))
    assert len(found) == 3


def test_a_model_fn_failure_keeps_its_traceback(tmp_path):
    from fsdp_fp8 import CheckpointError, load_model

    path = write_uneven_checkpoint(tmp_path / "ckpt")

    def model_fn(config):
        return undefined_name  # noqa: F821 - the user's mistake

    with pytest.raises(CheckpointError) as err:
        load_model(model_fn, path, device=torch.device("cpu"))
    assert isinstance(err.value.__cause__, NameError)
    frames = traceback.extract_tb(err.value.__cause__.__traceback__)
    assert frames[-1].name == "model_fn" and frames[-1].filename == __file__
    assert "in model_fn)" in str(err.value) and f"{__file__}:" in str(err.value)


def test_several_dtype_refusals_say_how_to_fix_them_in_one_line(tmp_path):
    from fsdp_fp8 import CheckpointError, load_model

    path = write_uneven_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as err:
        load_model(lambda c: uneven_model_fn(c).float(), path, device=torch.device("cpu"))
    fixes = [p for p in err.value.problems if "to fix all" in p]
    assert len(fixes) == 1 and "model_fn=None" in fixes[0] and "torch.bfloat16" in fixes[0], err.value.problems


def _torchrun_rank(rank: int, port: int, path: str, queue) -> None:
    import os

    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        from fsdp_fp8 import load_model

        loaded = load_model(uneven_model_fn, path, device=torch.device("cpu"))
        queue.put((rank, loaded.report.world_size, loaded.report.bytes_read))
        torch.distributed.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, repr(exc), None))


def test_under_torchrun_without_a_process_group_the_load_is_sharded(tmp_path):
    path = write_uneven_checkpoint(tmp_path / "ckpt")
    with socket.socket() as s:  # a free port for the env:// rendezvous torchrun would provide
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_torchrun_rank, args=(r, port, str(path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [(r, w) for r, w, _ in got] == [(0, 2), (1, 2)], got  # each rank in a group of 2, not alone
    from fsdp_fp8.format.checkpoint import open_checkpoint

    whole = sum(e.nbytes for e in open_checkpoint(path).tensors.values())
    assert all(n < whole for _, _, n in got)  # each rank read a share, not the whole model
