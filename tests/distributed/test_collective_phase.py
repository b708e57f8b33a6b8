"""``collective_phase``: the body runs locally, its exit is exactly one agreement on the outcome;
on any rank's failure the model is marked unusable and every rank raises the same error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_fp8.collective import collective_phase, unusable_reason
from fsdp_fp8.errors import LoadFailedError, ModelUnusableError


def _count_exchanges():
    from fsdp_fp8.collective import phase

    calls = []
    real = phase.exchange

    def counting(*args, **kwargs):
        calls.append(kwargs.get("stage"))
        return real(*args, **kwargs)

    phase.exchange = counting
    return calls


def test_without_ranks_a_failing_body_raises_once_and_the_model_refuses_to_run():
    model = nn.Linear(4, 4)
    with pytest.raises(LoadFailedError) as err:
        with collective_phase(model, "load", 1.0, failed="checkpoint load failed"):
            raise OSError("disk gone")
    assert str(err.value) == "checkpoint load failed on 1 of 1 ranks: 1 problem:\n  - rank 0: OSError: disk gone"
    assert isinstance(err.value.__cause__, OSError)  # the body's traceback is kept
    assert "disk gone" in unusable_reason(model)
    assert model.weight.untyped_storage().nbytes() == 0
    with pytest.raises(ModelUnusableError):
        model(torch.zeros(1, 4))


def test_a_body_that_succeeds_leaves_the_model_alone():
    model = nn.Linear(4, 4)
    with collective_phase(model, "load", 1.0):
        pass
    assert unusable_reason(model) is None
    assert model(torch.zeros(1, 4)).shape == (1, 4)


def _one_rank_fails(rank, world):
    calls = _count_exchanges()
    model = nn.Linear(4, 4)
    try:
        with collective_phase(model, "load", 30.0, failed="checkpoint load failed"):
            if rank == 1:
                raise RuntimeError("rank 1 broke")
    except LoadFailedError as exc:
        return str(exc), calls, unusable_reason(model) is not None
    return None, calls, False


def _every_rank_succeeds(rank, world):
    calls = _count_exchanges()
    with collective_phase(nn.Linear(2, 2), "load", 30.0):
        pass
    return calls


def test_one_rank_failing_raises_the_same_error_on_every_rank_after_one_exchange():
    from ranks import run_ranks

    results = run_ranks(_one_rank_fails, 3)
    texts = {text for text, _, _ in results}
    assert texts == {"checkpoint load failed on 1 of 3 ranks: 1 problem:\n  - rank 1: RuntimeError: rank 1 broke"}
    assert all(calls == ["agreement on the outcome of the load"] for _, calls, _ in results)
    assert all(marked for _, _, marked in results)


def test_success_costs_exactly_one_exchange():
    from ranks import run_ranks

    assert run_ranks(_every_rank_succeeds, 2) == [["agreement on the outcome of the load"]] * 2


@pytest.mark.parametrize(
    ("env", "value", "warns"),
    [
        ({"NCCL_SOCKET_IFNAME": "eth0,eth1"}, "eth0,eth1", False),
        ({"NCCL_SOCKET_IFNAME": "=ib0"}, "ib0", False),
        ({"NCCL_SOCKET_IFNAME": "^docker0,lo"}, None, True),
        ({"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth2"}, None, False),
        ({}, None, False),
    ],
)
def test_gloo_takes_ncc_interface_when_only_that_is_set(env, value, warns):
    from fsdp_fp8.collective.group import gloo_interface

    got, warning = gloo_interface(env)
    assert got == value and (warning is not None) == warns


def _side_group_with(rank, world, nccl_ifname):
    import os

    from fsdp_fp8.collective import exchange, side_group
    from fsdp_fp8.errors import PeerLostError

    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    os.environ["NCCL_SOCKET_IFNAME"] = nccl_ifname
    try:
        side_group(30.0, "cannot load ckpt")
    except PeerLostError as exc:
        return os.environ.get("GLOO_SOCKET_IFNAME"), str(exc)
    return os.environ.get("GLOO_SOCKET_IFNAME"), exchange(rank, timeout_s=30.0, stage="test", context="")


def test_the_side_group_uses_ncc_interface_and_names_the_variable_when_it_cannot_connect():
    from ranks import run_ranks

    assert run_ranks(_side_group_with, 2, "lo") == [("lo", [0, 1])] * 2
    for ifname, text in run_ranks(_side_group_with, 2, "nosuchif0"):
        assert ifname == "nosuchif0"
        assert "could not connect the gloo agreement group" in text and "GLOO_SOCKET_IFNAME" in text, text
