"""FSDP2 over static FP8 weights on a fake CUDA mesh at fake world sizes 3 and 8.

One rank of a world at a time, in this process: torch's fake process group
(``torch.testing._internal.distributed.fake_pg``) stands in for NCCL and FakeTensorMode for
the GPU. Rows do not divide evenly (7 rows over 3 or 8 ranks; 1 row leaves every rank but rank 0
with none), and the last rank of each world holds zero rows of some weight. Checked:
``fully_shard`` of the blocks and the root, each rank's residency (its ``torch.chunk`` rows of
codes in a padded CUDA shard, both scales on CUDA), the pre-all-gather hook through FSDP2's own
``FSDPParam.all_gather_inputs`` (uint8, padded to ``ceil(rows / world)``), FSDP2's copy-in, the
all-gather on the process group and FSDP2's copy-out into the post hook, a W8A8 forward of every
gathered weight under CUDA's ``_scaled_mm`` rules, and the reshard back to the rank's shard.

What cannot be faked, and is left to the GPU (tests/gpu, the smoke check's NCCL all-gather):
- FSDP2's streams and events (``torch.cuda.Stream``, ``record_event``): a CPU build has no CUDA
  runtime, so the forward hooks that schedule the all-gather on them cannot run; the test calls
  the same FSDP2 functions in their order without the streams (copy-in, all-gather, copy-out);
- the bytes: fake tensors hold no data and the fake process group moves none, so bit parity
  of the gathered codes is the gloo tests' (tests/distributed/test_fsdp_ops.py, tests/distributed/test_sharded_load.py);
- ``fully_shard``'s device lookup calls ``torch.cuda.current_device()``, answered here with 0;
- ``to_empty`` onto the fake device and CPU offload's copies (any copy onto a fake CUDA device:
  "PyTorch is not linked with support for cuda devices"), and pinning.
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import IN, fake_cuda
from fake_cuda import FakeMeshModel as _Model
from fake_cuda import gather_unsharded as _gather

from fsdp_fp8.fp8.tensor import E4M3, is_static_fp8


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    return len(torch.arange(rows).chunk(world)[rank]) if rank < len(torch.arange(rows).chunk(world)) else 0


@pytest.mark.parametrize("world, rank", [(3, 0), (3, 2), (8, 0), (8, 7)])
def test_fully_shard_gather_forward_and_reshard_on_a_fake_cuda_mesh(fake_rank, world, rank):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = fake_rank(rank, world)
    with fake_cuda() as rules:
        model = _Model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        linears = {f"{i}.{n}": m for i, b in enumerate(model.blocks) for n, m in b.named_children()}
        problems = []
        for name, lin in linears.items():  # residency: this rank's chunk rows, on the device
            w = lin.weight
            local = w._local_tensor if isinstance(w, DTensor) else None
            want = _chunk_rows(lin.out_features, world, rank)
            if local is None or not is_static_fp8(local) or local.shape[0] != want:
                problems.append(
                    f"{name}: local {type(local).__name__} {getattr(local, 'shape', None)}, want {want} rows"
                )
                continue
            on = {local.qdata.device.type, local.scale.device.type, local.act_quant_scale.device.type}
            if on != {"cuda"} or local.qdata.dtype != E4M3:
                problems.append(f"{name}: codes {local.qdata.dtype} and scales on {on}")
        assert not problems, problems

        for block in model.blocks:
            group = block._get_fsdp_state()._fsdp_param_group
            group.lazy_init()  # FSDP2's lazy init of the group: reset_sharded_param on every shard
            group._init_mp_dtypes()
            params = group.fsdp_params
            for p in params:  # the pre hook through FSDP2: uint8, padded to ceil(rows / world)
                if is_static_fp8(p._sharded_local_tensor):
                    (payload,) = p.all_gather_inputs
                    assert payload.dtype == torch.uint8 and payload.numel() == p.padded_sharded_param_size.numel()
            _gather(params, mesh.get_group())
            for name, lin in block.named_children():
                w = lin.weight
                assert is_static_fp8(w) and tuple(w.shape) == (lin.out_features, IN) and w.qdata.is_cuda, name
                # W8A8 where _scaled_mm takes the shape (multiples of 16), else W8A16 (the loader
                # refuses such a W8A8 linear on CUDA: fsdp_fp8.fp8.linear.cuda_shape_problems).
                w8a8 = lin.out_features % 16 == 0
                lin.mode = "native" if w8a8 else "a16"
                before = rules.scaled_mm
                y = lin(torch.empty(3, 5, IN, dtype=torch.bfloat16, device="cuda"))
                assert y.shape == (3, 5, lin.out_features) and rules.scaled_mm == before + w8a8, name
            for p in params:  # reshard: the module holds its sharded DTensor again
                p.to_sharded()
            for name, lin in block.named_children():
                local = lin.weight._local_tensor
                assert local.shape[0] == _chunk_rows(lin.out_features, world, rank), name
