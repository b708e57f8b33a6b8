"""``StaticFloat8Tensor`` and its op table, through FSDP2 on gloo ranks and one tensor at a time.

The FSDP2 flow is: fully_shard every block and the root, ``to_empty``, write every value
through each rank's real local shard, a forward (the uint8 all-gather) and, on a fresh model,
``Module.to(float32)``. With our entries the sharded forward equals the single-process forward
bit for bit. With TorchAO's own entry put back for one op of ``FSDP_OPS`` (or none, where
TorchAO has none) the same flow fails: that failure is why the op is in the table. The
``FAST_OPS`` entries are there for set-up cost only: with TorchAO's entry the flow gives the
same bits.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from ranks import run_ranks
from torch import nn
from torchao.prototype.quantization.float8_static_quant.prototype_float8_tensor import PrototypeFloat8Tensor
from torchao.quantization.granularity import PerRow

from fsdp_fp8.fp8 import ops
from fsdp_fp8.fp8.linear import Float8StaticLinear
from fsdp_fp8.fp8.tensor import (
    E4M3,
    FIELDS,
    StaticFloat8Tensor,
    is_static_fp8,
    make_static_fp8_weight,
    rebuild,
)

aten = torch.ops.aten
IN = 16
# 7 rows split unevenly by 2 and 3 ranks; 1 row leaves every rank but rank 0 with none
# (FSDP2 pads those ranks with new_empty(0)).
ROWS = {"up": 7, "down": IN, "gate": 1}


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = Float8StaticLinear(IN, ROWS["up"], True, torch.bfloat16, device="meta")
        self.down = Float8StaticLinear(ROWS["up"], ROWS["down"], False, torch.bfloat16, device="meta")
        self.gate = Float8StaticLinear(IN, ROWS["gate"], False, torch.bfloat16, device="meta")

    def forward(self, x):
        return self.down(self.up(x)) * self.gate(x) + x


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _values(layer: int, name: str, lin: Float8StaticLinear):
    g = torch.Generator().manual_seed(1000 * layer + sum(map(ord, name)))
    codes = (torch.randn(lin.out_features, lin.in_features, generator=g) * 64).to(E4M3)
    return codes, 0.01 + 0.001 * layer, 0.02 + 0.003 * len(name), torch.randn(lin.out_features, generator=g)


def _fill(model: _Model, rank: int, world: int) -> None:
    """Every value through each rank's real local storage: the rows ``chunk(world)`` gives it."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            for name, lin in block.named_children():
                codes, scale, input_scale, bias = _values(layer, name, lin)
                start = rank * -(-lin.out_features // world)
                w = local(lin.weight)
                w.qdata.copy_(codes[start : start + w.shape[0]])
                w.scale.fill_(scale)
                w.act_quant_scale.fill_(input_scale)
                if lin.bias is not None:
                    b = local(lin.bias)
                    b.copy_(bias[start : start + b.shape[0]].to(b.dtype))


def _x(dtype=torch.bfloat16):
    return torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(7)).to(dtype)


def _reference(dtype=torch.bfloat16) -> torch.Tensor:
    model = _Model().to_empty(device="cpu")
    _fill(model, 0, 1)
    model.to(dtype)
    with torch.no_grad():
        return model(_x(dtype))


def _flow(rank: int, world: int) -> dict:
    """One sharded life; the ranks agree on failure after each phase, so none waits on a peer."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    out: dict = {"failures": []}

    def agreed(fn):
        try:
            result, failure = fn(), None
        except Exception as e:  # the op under test may fail in any way
            result, failure = None, f"{type(e).__name__}: {e}"[:300]
        flag = torch.tensor([float(failure is not None)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if failure:
            out["failures"].append(failure)
        return result, bool(flag.item())

    def build():
        model = _Model()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        _fill(model, rank, world)
        return model

    def forward(model, dtype=torch.bfloat16):
        with torch.no_grad():
            return model(_x(dtype))

    model, failed = agreed(build)
    if not failed:
        out["y"], failed = agreed(lambda: forward(model))

    def cast():
        # Before the first forward: FSDP2 fixes its all-gather dtypes at lazy init.
        fresh = build().to(torch.float32)
        dtype = fresh.blocks[0].up.weight._local_tensor.dtype
        if dtype != torch.float32:
            raise TypeError(f"the local shard's compute dtype stayed {dtype}")
        return forward(fresh, torch.float32)

    if not failed:
        out["y32"], _ = agreed(cast)
    return out


def _trials(rank: int, world: int) -> dict:
    """The flow with our table (counting the calls), then once per op with TorchAO's entry."""
    table = StaticFloat8Tensor._ATEN_OP_TABLE[StaticFloat8Tensor]
    torchao = ops.torchao_table()
    ours = {op: table[op] for op in (*ops.FSDP_OPS, *ops.FAST_OPS)}
    calls: dict[str, int] = {}

    def counting(op):
        def entry(func, types, args, kwargs):
            calls[str(op)] = calls.get(str(op), 0) + 1
            return ours[op](func, types, args, kwargs)

        return entry

    table.update({op: counting(op) for op in ours})
    try:
        results = {"ours": _flow(rank, world)}
    finally:
        table.update(ours)
    results["calls"] = calls
    for op in ours:
        if op in torchao:
            table[op] = torchao[op]
        else:
            del table[op]
        try:
            results[str(op)] = _flow(rank, world)
        finally:
            table[op] = ours[op]
    return results


@pytest.fixture(scope="module", params=(2, 3))
def trials(request):
    return run_ranks(_trials, request.param, timeout=300)


def test_sharded_forward_equals_the_single_process_forward_bit_for_bit(trials):
    ref, ref32 = _reference(), _reference(torch.float32)
    for r in trials:
        assert not r["ours"]["failures"]
        assert torch.equal(r["ours"]["y"], ref) and torch.equal(r["ours"]["y32"], ref32)


def test_every_op_in_the_table_is_reached_through_fsdp2(trials):
    reached = set().union(*(r["calls"] for r in trials))
    assert {str(op) for op in (*ops.FSDP_OPS, *ops.FAST_OPS)} <= reached


@pytest.mark.parametrize("op", sorted(ops.FSDP_OPS, key=str), ids=str)
def test_with_torchaos_own_entry_the_fsdp2_flow_fails(trials, op):
    failures = [f for r in trials for f in r[str(op)]["failures"]]
    assert failures, f"TorchAO's own {op} passed the FSDP2 flow: ours would not be needed"
    if op in ops.torchao_table():  # TorchAO's entry runs and gets our tensor wrong
        assert all(f.split(":")[0] in ("AssertionError", "TypeError", "ValueError") for f in failures), failures
    else:  # TorchAO has no entry
        assert all(f.startswith("NotImplementedError") and "unimplemented operator" in f for f in failures), failures


@pytest.mark.parametrize("op", sorted(ops.FAST_OPS, key=str), ids=str)
def test_fast_entries_give_torchaos_bits_through_fsdp2(trials, op):
    assert op in ops.torchao_table() and op not in ops.FSDP_OPS
    for r in trials:
        theirs = r[str(op)]
        assert not theirs["failures"], theirs["failures"]
        assert torch.equal(theirs["y"], r["ours"]["y"]) and torch.equal(theirs["y32"], r["ours"]["y32"])


# --- one tensor at a time ----------------------------------------------------------------


def _weight(rows=7, cols=16) -> StaticFloat8Tensor:
    codes = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(E4M3)
    return make_static_fp8_weight(codes, torch.tensor(0.5), torch.tensor(0.25), torch.bfloat16)


def test_torchaos_table_is_required_not_defaulted(monkeypatch):
    monkeypatch.setattr(PrototypeFloat8Tensor, "_ATEN_OP_TABLE", {})
    with pytest.raises(KeyError, match="`_ATEN_OP_TABLE`"):
        ops.torchao_table()
    monkeypatch.delattr(PrototypeFloat8Tensor, "_ATEN_OP_TABLE")
    with pytest.raises(KeyError, match="torchao 0.18"):
        ops._register()


def test_importing_any_module_of_the_layer_registers_the_ops():
    code = (
        "import sys, fsdp_fp8.fp8.tensor as t; o = sys.modules['fsdp_fp8.fp8.ops'];"
        "table = t.StaticFloat8Tensor._ATEN_OP_TABLE[t.StaticFloat8Tensor];"
        "assert all(table[op].__wrapped__ is impl for op, impl in (o.FSDP_OPS | o.FAST_OPS).items())"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torchaos_own_class_is_untouched():
    """Our entries sit in the subclass's table: a per-row tensor keeps TorchAO's behaviour."""
    torchao = ops.torchao_table()
    for op in ops.FSDP_OPS:
        assert torchao.get(op) is not StaticFloat8Tensor._ATEN_OP_TABLE[StaticFloat8Tensor][op]
    per_row = PrototypeFloat8Tensor.from_hp(torch.randn(4, 16), granularity=PerRow())
    assert not is_static_fp8(per_row) and not hasattr(per_row, "fsdp_pre_all_gather")
    piece = aten.slice.Tensor(per_row, 0, 0, 2)
    assert tuple(piece.scale.shape) == (2, 1)  # TorchAO sliced the per-row scales


class _Mesh:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_hooks_refuse_a_tensor_that_is_no_longer_per_tensor():
    w = _weight()
    w.scale = torch.ones(7, 1)  # what a per-row weight would carry
    with pytest.raises(TypeError, match="not per-tensor static FP8"):
        w.fsdp_pre_all_gather(_Mesh(3), torch.Size([7, 16]), (16, 1), None, None)
    per_row = PrototypeFloat8Tensor.from_hp(torch.randn(7, 16), granularity=PerRow())
    with pytest.raises(TypeError, match="PrototypeFloat8Tensor"):
        StaticFloat8Tensor.fsdp_post_all_gather(per_row, (torch.zeros(9, 16, dtype=torch.uint8),), ((7, 16),), None)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"scale": torch.ones(7, 1)}, "weight scale has 7 elements"),
        ({"act_quant_scale": None}, "activation scale"),
        ({"output_act_quant_scale": torch.ones(1, 1)}, "output_act_quant"),
        ({"qdata": torch.zeros(7, 16)}, "codes are torch.float32"),
    ],
)
def test_the_constructor_refuses_anything_but_static_per_tensor_fp8(change, message):
    w = _weight()
    fields = {name: getattr(w, name) for name in FIELDS} | change
    with pytest.raises(ValueError, match=message):
        StaticFloat8Tensor(**fields)


def test_rebuild_carries_every_constructor_field():
    import inspect

    assert tuple(inspect.signature(PrototypeFloat8Tensor.__init__).parameters)[1:] == FIELDS
    w = _weight()
    # A distinct value in every non-tensor field, so a field rebuild dropped would show.
    w.mm_config, w.kernel_preference = object(), object()
    w.act_quant_kwargs = object()
    piece = rebuild(w, w.qdata[2:5])
    for name in FIELDS:
        if name == "qdata":
            assert piece.qdata.data_ptr() == w.qdata[2:5].data_ptr()
        elif name == "block_size":
            assert piece.block_size == [3, 16]
        else:
            assert getattr(piece, name) is getattr(w, name), name


def test_is_static_fp8_needs_no_output_quantization():
    w = _weight()
    assert is_static_fp8(w)
    w.output_act_quant_kwargs = object()
    assert not is_static_fp8(w)


def test_pre_all_gather_sends_uint8_padded_rows_and_post_views_back():
    w = _weight()
    shard = w.split(3)[2]  # rank 2 of 3 holds 1 row; the padded shard has ceil(7/3) = 3
    (payload,), meta = shard.fsdp_pre_all_gather(_Mesh(3), torch.Size([7, 16]), (16, 1), None, None)
    assert payload.dtype == torch.uint8 and tuple(payload.shape) == (3, 16)
    assert torch.equal(payload[:1], shard.qdata.view(torch.uint8)) and not payload[1:].any()
    gathered = torch.cat([w.qdata.view(torch.uint8), torch.zeros(2, 16, dtype=torch.uint8)])
    full, inner = shard.fsdp_post_all_gather((gathered,), meta, torch.bfloat16)
    assert is_static_fp8(full) and tuple(full.shape) == (7, 16) and inner == (gathered,)
    assert torch.equal(full.qdata.view(torch.uint8), w.qdata.view(torch.uint8))
    other = torch.zeros_like(gathered)
    assert shard.fsdp_post_all_gather((other,), meta, torch.bfloat16, out=full) is None
    assert not full.qdata.view(torch.uint8).any()  # out= was written in place


# --- CPU offload: fully_shard(..., offload_policy=CPUOffloadPolicy()) ------------------------


def test_is_pinned_and_pin_memory_reach_the_codes_and_both_scales():
    w = _weight()
    assert w.is_pinned() is False
    if torch.cuda.is_available():  # a CUDA build pins: codes and both scales, the same bytes
        pinned = w.pin_memory()
        assert pinned.is_pinned() and all(t.is_pinned() for t in (pinned.qdata, pinned.scale, pinned.act_quant_scale))
        assert torch.equal(pinned.qdata.view(torch.uint8), w.qdata.view(torch.uint8))
        return
    # A CPU-only build cannot pin anything: the weight fails as its codes do, not on a missing op.
    with pytest.raises(RuntimeError) as plain:
        w.qdata.pin_memory()
    with pytest.raises(RuntimeError) as ours:
        w.pin_memory()
    assert str(ours.value) == str(plain.value)


def _offloaded(rank: int, world: int) -> dict:
    """The model sharded with CPU offload: unpinned (CPU builds run it) and pinned (FSDPParam calls
    is_pinned / pin_memory on each shard; only an accelerator build can pin), next to a plain
    linear under the pinned policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    out = {}
    for pin in (False, True):
        model = _Model().to_empty(device="cpu")
        _fill(model, 0, 1)  # offload wants materialized CPU parameters before fully_shard
        policy = CPUOffloadPolicy(pin_memory=pin)
        try:
            for block in model.blocks:
                fully_shard(block, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
            with torch.no_grad():
                out[pin] = {"y": model(_x()), "device": str(model.blocks[0].up.weight.device)}
        except Exception as e:
            out[pin] = {"error": f"{type(e).__name__}: {e}"}
    try:
        fully_shard(nn.Linear(IN, 8), offload_policy=CPUOffloadPolicy())
        out["plain"] = {"error": None}
    except Exception as e:
        out["plain"] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.fixture(scope="module")
def offloaded():
    return run_ranks(_offloaded, 2, timeout=300)


def test_cpu_offload_gives_the_single_process_bits(offloaded):
    ref = _reference()
    for r in offloaded:
        assert "error" not in r[False], r[False]
        assert r[False]["device"] == "cpu" and torch.equal(r[False]["y"], ref)


def test_pinned_cpu_offload_reaches_pinning_as_a_plain_linear_does(offloaded):
    for r in offloaded:
        if r["plain"]["error"] is None:  # an accelerator build: pinned shards, same bits
            assert torch.equal(r[True]["y"], _reference())
        else:  # CPU-only: the same error a plain nn.Linear gets, never "unimplemented operator"
            assert r[True].get("error") == r["plain"]["error"], (r[True], r["plain"])
