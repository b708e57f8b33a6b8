"""Sharded loading end to end on gloo ranks: round trip, parity, bytes, memory, reads.

One spawn per world size observes everything (process start-up dominates on CPU); the
tests below judge those observations.
"""

from __future__ import annotations

import math

import pytest
import torch
from ranks import run_ranks
from small_models import FIXTURE, HIDDEN, fixture_llama_fn, load_files, uneven_model_fn, write_uneven_checkpoint

from fsdp_fp8.load.plan import plan_load

WORLD_SIZES = (1, 2, 3, 4)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _mismatches(gathered: dict, directory) -> list[str]:
    files = load_files(directory)
    problems = [f"missing {k}" for k in sorted(set(files) - set(gathered))]
    problems += [f"extra {k}" for k in sorted(set(gathered) - set(files))]
    problems += [
        f"{k}: {gathered[k].dtype} {tuple(gathered[k].shape)} vs file {files[k].dtype} {tuple(files[k].shape)}"
        for k in sorted(set(files) & set(gathered))
        if not _same_bytes(gathered[k], files[k])
    ]
    return problems


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (shape, dtype) of every real (non-meta) plain tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[tuple[int, ...], torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if type(t) is torch.Tensor and not t.is_meta:
                self.seen.add((tuple(t.shape), t.dtype))
        return out


def _count_our_ops() -> dict[str, int]:
    """Wrap each op fsdp_fp8 registered; counts the calls that reach it."""
    from fsdp_fp8.fp8.ops import FSDP_OPS
    from fsdp_fp8.fp8.tensor import StaticFloat8Tensor

    calls: dict[str, int] = {}
    table = StaticFloat8Tensor._ATEN_OP_TABLE[StaticFloat8Tensor]
    for op in FSDP_OPS:

        def counting(func, types, args, kwargs, _inner=table[op]):
            calls[func.__name__] = calls.get(func.__name__, 0) + 1
            return _inner(func, types, args, kwargs)

        table[op] = counting
    return calls


def _observe(rank: int, world: int, uneven_dir: str) -> dict:
    from fsdp_fp8 import gather_state_dict, load_checkpoint, open_checkpoint, swap_fp8_linears
    from fsdp_fp8.compose.model import load_model
    from fsdp_fp8.load.fsdp_wrap import default_mesh, shard_model
    from fsdp_fp8.load.meta_build import materialize, meta_init, tensors_on_meta
    from fsdp_fp8.runtime.allgather_meter import AllGatherMeter

    obs: dict = {}
    op_calls = _count_our_ops()
    # Phase by phase, so allocations during materialize + load can be watched.
    ckpt = open_checkpoint(uneven_dir)
    with meta_init():
        model = uneven_model_fn(ckpt.config)
    plan = plan_load(ckpt, model)
    swap_fp8_linears(model, plan)
    shard_model(model, default_mesh("cpu"))
    with _Allocations() as allocations:
        materialize(model, torch.device("cpu"))
        report = load_checkpoint(model, plan)
    fp8_shapes = {tuple(t.entry.weight.shape) for t in plan.fp8}
    obs["hp_copies_of_fp8"] = sorted(str(s) for s, dt in allocations.seen if s in fp8_shapes and dt.itemsize > 1)
    obs["on_meta"] = tensors_on_meta(model)
    obs["bytes_read"] = report.bytes_read
    local = {}
    for t in plan.fp8:
        q = model.get_submodule(t.module).weight._local_tensor.qdata
        local[t.module] = (tuple(q.shape), str(q.dtype), q.untyped_storage().nbytes())
    obs["local_after_to_empty"] = local

    x = torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad(), AllGatherMeter() as meter:  # the collective FSDP2 calls on this torch
        obs["y"] = model(x)
    obs["all_gather_bytes"] = meter.bytes
    obs["op_calls"] = dict(op_calls)
    obs["storage_after_forward"] = {
        t.module: model.get_submodule(t.module).weight._local_tensor.qdata.untyped_storage().nbytes() for t in plan.fp8
    }
    with torch.no_grad():
        obs["y_empty_shape"] = tuple(model(x[:, :0]).shape)
        obs["y_again"] = model(x)
    gathered = gather_state_dict(model)
    obs["uneven_mismatches"] = _mismatches(gathered, uneven_dir) if rank == 0 else None

    loaded = load_model(fixture_llama_fn, FIXTURE)
    gathered = gather_state_dict(loaded.model)
    obs["fixture_mismatches"] = _mismatches(gathered, FIXTURE) if rank == 0 else None
    obs["fixture_fp8"] = len(loaded.fp8_linears)
    obs["fixture_bytes_read"] = loaded.report.bytes_read
    return obs


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory):
    return write_uneven_checkpoint(tmp_path_factory.mktemp("uneven"))


@pytest.fixture(scope="module")
def observed(uneven_dir):
    return {w: run_ranks(_observe, w, str(uneven_dir), timeout=180) for w in WORLD_SIZES}


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gathered_state_equals_the_files_bit_for_bit(observed, world):
    rank0 = observed[world][0]
    assert rank0["uneven_mismatches"] == []
    assert rank0["fixture_mismatches"] == []
    assert rank0["fixture_fp8"] == 14  # 2 layers x q/k/v/o/gate/up/down


@pytest.fixture(scope="module")
def single_process_y(uneven_dir):
    """The reference: the same checkpoint loaded in this process, with no process group
    (a plain module, no FSDP, no DTensor)."""
    import torch.distributed as dist

    from fsdp_fp8.compose.model import load_model

    assert not dist.is_initialized()
    model = load_model(uneven_model_fn, uneven_dir, device=torch.device("cpu")).model
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
    x = torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sharded_forward_equals_single_process_bit_for_bit(observed, single_process_y, world):
    reference = single_process_y
    for obs in observed[world]:
        assert torch.equal(obs["y"], reference)
        assert torch.equal(obs["y_again"], reference)
        assert obs["y_empty_shape"] == (3, 0, 6)


def test_forward_matches_dequantized_reference(observed, uneven_dir):
    from small_models import UnevenModel

    files = load_files(uneven_dir)
    model = UnevenModel(dtype=torch.float32)
    state = {}
    for key, value in files.items():
        if key.endswith("_scale"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            value = value.float() * files[key.replace(".weight", ".weight_scale")]
        state[key] = value.float()
    model.load_state_dict(state)
    x = torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad():
        expected = model(x.float())
    got = observed[1][0]["y"].float()
    assert not torch.equal(got, expected)  # the FP8 path really quantizes activations
    torch.testing.assert_close(got, expected, atol=0.08, rtol=0.08)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_nothing_left_on_meta_and_no_high_precision_copy_of_fp8_weights(observed, world):
    for obs in observed[world]:
        assert obs["on_meta"] == []
        assert obs["hp_copies_of_fp8"] == []


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fp8_local_storage_is_one_byte_per_element_of_the_rank_chunk(observed, world):
    rows = {"up": 7, "down": 16, "gate": 1}
    cols = {"up": HIDDEN, "down": 7, "gate": HIDDEN}
    for rank, obs in enumerate(observed[world]):
        for module, (shape, dtype, nbytes) in obs["local_after_to_empty"].items():
            kind = module.rsplit(".", 1)[1]
            chunk = math.ceil(rows[kind] / world)
            mine = max(0, min(rows[kind], (rank + 1) * chunk) - rank * chunk)
            assert dtype == "torch.float8_e4m3fn"
            assert shape == (mine, cols[kind])
            assert mine * cols[kind] <= nbytes <= chunk * cols[kind]
            # After FSDP2's lazy init the shard sits in its padded buffer: ceil(rows/W) rows.
            assert obs["storage_after_forward"][module] == chunk * cols[kind]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_gather_moves_one_byte_per_fp8_element(observed, world):
    def padded(rows, row_numel, itemsize):
        return math.ceil(rows / world) * row_numel * itemsize

    def block(fp8_itemsize):
        return (
            padded(HIDDEN, 1, 2)  # norm
            + padded(7, HIDDEN, fp8_itemsize)
            + padded(7, 1, 2)  # up + bias
            + padded(HIDDEN, 7, fp8_itemsize)  # down
            + padded(1, HIDDEN, fp8_itemsize)
            + padded(1, 1, 2)  # gate + bias
        )

    root = padded(6, HIDDEN, 2)  # the BF16 head
    for obs in observed[world]:
        if world == 1:  # FSDP2 does not call a collective for a one-rank mesh
            assert obs["all_gather_bytes"] == 0
            continue
        assert obs["all_gather_bytes"] == 2 * block(1) + root
        assert obs["all_gather_bytes"] < 2 * block(2) + root


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_each_rank_reads_about_one_over_world_of_the_bytes(observed, uneven_dir, world):
    files = load_files(uneven_dir)
    total = sum(t.numel() * t.element_size() for t in files.values())
    # What every rank must read whole: the (unsharded) buffer. The scales were read once, when
    # the checkpoint was opened, and load from the values checked then, never read again.
    scales = sum(t.numel() * t.element_size() for k, t in files.items() if k.endswith("_scale"))
    replicated = sum(t.numel() * t.element_size() for k, t in files.items() if k == "shift")
    read = [obs["bytes_read"] for obs in observed[world]]
    assert sum(read) == total - scales + (world - 1) * replicated
    fixture_total = sum(t.numel() * t.element_size() for t in load_files(FIXTURE).values())
    fixture_read = sum(obs["fixture_bytes_read"] for obs in observed[world])
    fixture_scales = sum(t.numel() * t.element_size() for k, t in load_files(FIXTURE).items() if k.endswith("_scale"))
    assert fixture_total - fixture_scales <= fixture_read <= fixture_total * 1.05 + world * 14 * 8


@pytest.mark.parametrize("world", (2, 4))
def test_fsdp2_goes_through_our_ops(observed, world):
    """fully_shard, to_empty, lazy init and the all-gather use these ops on our tensors;
    test_fsdp_ops.py shows each fails without our registration."""
    hit = set().union(*(obs["op_calls"] for obs in observed[world]))
    expected = {
        "split.Tensor",
        "slice.Tensor",
        "view.default",
        "as_strided.default",
        "new_zeros.default",
        "empty_like.default",
    }
    if world == 4:  # the 1-row linear has fewer chunks than ranks: FSDP2 pads with new_empty(0)
        expected.add("new_empty.default")
    assert expected <= hit
