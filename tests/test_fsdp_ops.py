"""Each aten op we register for static-FP8 ``PrototypeFloat8Tensor``: it works, and without
it (TorchAO 0.18's own entry, or none) the same call fails. The FSDP2 flow that hits these
ops at 1-4 ranks is in test_sharded_load.py (see ``test_fsdp2_goes_through_our_ops``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torchao.prototype.quantization.float8_static_quant.prototype_float8_tensor import PrototypeFloat8Tensor

from fsdp_fp8.fp8.tensor import E4M3, is_static_fp8, make_static_fp8_weight
from fsdp_fp8.fp8.ops import REGISTERED_OPS, TORCHAO_ORIGINALS, install_fsdp_support

aten = torch.ops.aten
install_fsdp_support()


def _weight(rows=7, cols=16):
    codes = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(E4M3)
    return make_static_fp8_weight(codes, torch.tensor(0.5), torch.tensor(0.25), torch.bfloat16)


@contextlib.contextmanager
def torchao_only(op_name: str):
    """Put TorchAO's own entry (or none) back for one op."""
    packet, overload = op_name.split(".")
    op = getattr(getattr(aten, packet), overload)
    table = PrototypeFloat8Tensor._ATEN_OP_TABLE[PrototypeFloat8Tensor]
    ours = table[op]
    if TORCHAO_ORIGINALS[op] is None:
        del table[op]
    else:
        table[op] = TORCHAO_ORIGINALS[op]
    try:
        yield
    finally:
        table[op] = ours


def _same_codes(a, b):
    return torch.equal(a.qdata.view(torch.uint8), b.view(torch.uint8) if b.dtype == E4M3 else b)


def _check_split(w):
    pieces = w.split(3)  # dim left at its default, as torch.chunk's decomposition may pass it
    assert [tuple(p.shape) for p in pieces] == [(3, 16), (3, 16), (1, 16)]
    for p, ref in zip(pieces, w.qdata.split(3)):
        assert is_static_fp8(p) and _same_codes(p, ref) and p.block_size == list(p.shape)
    assert [tuple(p.shape) for p in torch.split(w, 4, dim=0)] == [(4, 16), (3, 16)]
    assert w.block_size == [7, 16]  # the source is untouched


def _check_slice(w):
    s = aten.slice.Tensor(w, 0, 2)  # end omitted
    assert tuple(s.shape) == (5, 16) and _same_codes(s, w.qdata[2:])
    empty_1d = w.new_empty((0,))  # what FSDP2 gives a rank beyond the last chunk
    assert tuple(empty_1d.narrow(0, 0, 0).shape) == (0,)


def _check_view(w):
    flat = w.view(-1)  # FSDP2 keeps a flat view of every padded shard
    assert tuple(flat.shape) == (112,) and torch.equal(flat.qdata.view(torch.uint8), w.qdata.reshape(-1).view(torch.uint8))
    assert flat.scale is w.scale


def _check_as_strided(w):
    s = torch.as_strided(w, (6, 16), (16, 1), 0)  # FSDP2 trims the gathered rows this way
    assert tuple(s.shape) == (6, 16) and _same_codes(s, w.qdata[:6])


def _check_new_zeros(w):
    z = w.new_zeros((3, 16))
    assert is_static_fp8(z) and z.qdata.dtype == E4M3 and not z.qdata.view(torch.uint8).any()
    assert torch.equal(z.scale, w.scale) and z.scale is not w.scale


def _check_new_empty(w):
    e = w.new_empty((0,))
    assert is_static_fp8(e) and tuple(e.shape) == (0,) and e.qdata.dtype == E4M3


def _check_empty_like(w):
    e = torch.empty_like(w)  # what Module.to_empty runs
    assert is_static_fp8(e) and e.shape == w.shape and e.qdata.dtype == E4M3 and e.dtype == torch.bfloat16
    m = torch.empty_like(w, device="meta")
    assert m.qdata.is_meta and m.scale.is_meta


def _check_zeros_like(w):
    z = torch.zeros_like(w)
    assert is_static_fp8(z) and z.shape == w.shape and not z.qdata.view(torch.uint8).any()


def _check_to_copy(w):
    f = w.to(torch.float32)  # Module.float(): the compute dtype changes, the codes never do
    assert f.dtype == torch.float32 and f.qdata.dtype == E4M3 and _same_codes(f, w.qdata)
    with pytest.raises(TypeError, match="codes stay E4M3"):
        w.to(torch.uint8)


CHECKS = {
    "split.Tensor": _check_split,
    "slice.Tensor": _check_slice,
    "view.default": _check_view,
    "as_strided.default": _check_as_strided,
    "new_zeros.default": _check_new_zeros,
    "new_empty.default": _check_new_empty,
    "empty_like.default": _check_empty_like,
    "zeros_like.default": _check_zeros_like,
    "_to_copy.default": _check_to_copy,
}


def test_every_registered_op_has_a_check():
    assert set(CHECKS) == set(REGISTERED_OPS)


@pytest.mark.parametrize("op_name", sorted(CHECKS))
def test_op_works_on_static_fp8_weights(op_name):
    CHECKS[op_name](_weight())


@pytest.mark.parametrize("op_name", sorted(CHECKS))
def test_op_fails_without_our_registration(op_name):
    w = _weight()  # built with our ops in place: only the check itself runs without them
    packet, overload = op_name.split(".")
    if TORCHAO_ORIGINALS[getattr(getattr(aten, packet), overload)] is None:
        expected, match = NotImplementedError, "unimplemented operator"  # TorchAO has no entry
    else:  # TorchAO's own entry runs and gets our tensors wrong (or refuses their shapes)
        expected, match = (AssertionError, TypeError, ValueError), None
    with torchao_only(op_name):
        with pytest.raises(expected, match=match):
            CHECKS[op_name](w)


def test_install_is_idempotent():
    table = dict(PrototypeFloat8Tensor._ATEN_OP_TABLE[PrototypeFloat8Tensor])
    install_fsdp_support()
    assert PrototypeFloat8Tensor._ATEN_OP_TABLE[PrototypeFloat8Tensor] == table


def test_other_prototype_tensors_keep_torchaos_behaviour():
    """A per-row tensor is not ours: our overrides hand it to TorchAO's own entries."""
    from torchao.quantization.granularity import PerRow

    per_row = PrototypeFloat8Tensor.from_hp(torch.randn(4, 16), granularity=PerRow())
    assert not is_static_fp8(per_row)
    piece = aten.slice.Tensor(per_row, 0, 0, 2)
    assert tuple(piece.scale.shape) == (2, 1)  # TorchAO sliced the per-row scales


def test_pre_all_gather_sends_uint8_padded_rows_and_post_views_back():
    from fsdp_fp8.fp8.ops import fsdp_post_all_gather, fsdp_pre_all_gather

    class Mesh:
        def size(self):
            return 3

    w = _weight()
    shard = w.split(3)[2]  # rank 2 of 3 holds 1 row; the padded shard has ceil(7/3) = 3
    (payload,), meta = fsdp_pre_all_gather(shard, Mesh(), torch.Size([7, 16]), (16, 1), None, None)
    assert payload.dtype == torch.uint8 and tuple(payload.shape) == (3, 16)
    assert torch.equal(payload[:1], shard.qdata.view(torch.uint8)) and not payload[1:].any()
    gathered = torch.cat([w.qdata.view(torch.uint8), torch.zeros(2, 16, dtype=torch.uint8)])
    full, inner = fsdp_post_all_gather(shard, (gathered,), meta, torch.bfloat16)
    assert tuple(full.shape) == (7, 16) and _same_codes(full, w.qdata) and inner == (gathered,)
    out = full
    assert fsdp_post_all_gather(shard, (gathered,), meta, torch.bfloat16, out=out) is None
