"""Failures on one rank outside the reader (the user's model_fn, fully_shard, to_empty) still
fail every rank with the same error, never strand the others in a collective."""

from __future__ import annotations

import time

import pytest
import torch
from calibration import bound
from ranks import run_ranks
from small_models import uneven_model_fn, write_uneven_checkpoint


def _one_rank_fails(rank, world, path):
    import fsdp_fp8.compose.model as composed
    import fsdp_fp8.load.fsdp_wrap as fsdp_wrap
    from fsdp_fp8 import CheckpointError, load_model
    from fsdp_fp8.errors import LoadFailedError, ModelUnusableError

    out = {}

    def model_fn(config):
        if rank == 1:
            raise RuntimeError("model_fn broke on rank 1")
        return uneven_model_fn(config)

    t0 = time.perf_counter()
    try:
        load_model(model_fn, path)
    except CheckpointError as exc:
        out["model_fn"] = (type(exc).__name__, str(exc), time.perf_counter() - t0)

    real = fsdp_wrap.shard_model

    def shard_model(model, mesh):
        if rank == 1:
            raise RuntimeError("fully_shard broke on rank 1")
        return real(model, mesh)

    fsdp_wrap.shard_model = shard_model
    captured = {}
    real_materialize = composed.materialize

    def materialize(model, device):
        captured["model"] = model
        return real_materialize(model, device)

    composed.materialize = materialize
    t0 = time.perf_counter()
    try:
        load_model(uneven_model_fn, path)
    except LoadFailedError as exc:
        out["prepare"] = (type(exc).__name__, str(exc), time.perf_counter() - t0)
    finally:
        fsdp_wrap.shard_model, composed.materialize = real, real_materialize
    if rank == 0:  # rank 0's model was sharded and materialized but must refuse to run
        try:
            captured["model"](torch.zeros(1, 16, dtype=torch.bfloat16))
        except ModelUnusableError as exc:
            out["unusable"] = str(exc)
    return out


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    path = write_uneven_checkpoint(tmp_path_factory.mktemp("uneven"))
    return run_ranks(_one_rank_fails, 2, str(path), timeout=120)


def test_a_model_fn_failing_on_one_rank_fails_every_rank_before_anything_is_built(observed):
    for obs in observed:
        kind, text, seconds = obs["model_fn"]
        assert kind == "CheckpointError" and "rank 1: RuntimeError: model_fn broke on rank 1" in text
        assert seconds < bound(30)


def test_fully_shard_failing_on_one_rank_fails_every_rank_and_the_model_is_unusable(observed):
    for obs in observed:
        kind, text, seconds = obs["prepare"]
        assert kind == "LoadFailedError" and "rank 1: RuntimeError: fully_shard broke on rank 1" in text
        assert seconds < bound(30)
    assert "fully_shard broke on rank 1" in observed[0]["unusable"]


def test_fp8_linears_cuda_cannot_multiply_are_refused_before_loading_onto_cuda(tmp_path):
    """The 7-, 16- and 1-row linears of the uneven model: CUDA's _scaled_mm needs multiples of 16.
    Checked without a GPU: the refusal comes before anything touches the device."""
    from fsdp_fp8 import CheckpointError, load_model

    path = write_uneven_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as err:
        load_model(uneven_model_fn, path, device=torch.device("cuda", 0))
    text = str(err.value)
    assert "`layers.0.up` is an FP8 linear of shape (7, 16)" in text
    assert "`layers.1.down` is an FP8 linear of shape (16, 7)" in text
    assert "multiples of 16" in text


def _problems_found(rank, world):
    from fsdp_fp8 import CheckpointError
    from fsdp_fp8.collective.agreement import agree_or_raise

    found = ["`a.weight` in model.safetensors is broken"]
    if rank == 1:
        found.append("`b.weight` in model.safetensors looks different from here")
    try:
        agree_or_raise(found, None, "cannot load ckpt")
    except CheckpointError as exc:
        return exc.problems, str(exc)
    return None


def test_a_problem_every_rank_finds_is_listed_once_naming_the_ranks():
    for problems, text in run_ranks(_problems_found, 3):
        assert problems == [
            "all 3 ranks: `a.weight` in model.safetensors is broken",
            "rank 1: `b.weight` in model.safetensors looks different from here",
        ]
        assert text.startswith("cannot load ckpt: 2 problems:\n")


def test_merged_problems_name_every_rank_that_found_them():
    from fsdp_fp8.collective.agreement import merge_rank_problems

    found = [(3, "x"), (1, "x"), (0, "y"), (1, "y"), (2, "y"), (3, "y"), (2, "z")]
    assert merge_rank_problems(found, 4) == ["ranks 1, 3: x", "all 4 ranks: y", "rank 2: z"]
    assert merge_rank_problems([(0, "x")], 1) == ["rank 0: x"]
