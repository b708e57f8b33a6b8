"""Ulysses attention's local work on fake CUDA (tests/fake_cuda.py): the rows a rank keeps,
the packing around the all-to-alls, the head slices and the attention, with CUDA's rules (one
device per op, ``_scaled_mm``'s layouts on the FP8 projections, contiguous collective buffers).

A collective cannot run on fake tensors: here a rank's all-to-all and all-gather hand its own
buffer back (``Loopback``), which keeps every shape, dtype, device and layout of the real call.
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import fake_cuda
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_fp8.fp8.linear import Float8StaticLinear
from fsdp_fp8.interop.ulysses import Ulysses, UlyssesCosmos3AttnProcessor

pytest.importorskip("diffusers")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16  # multiples of 16: W8A8 runs on CUDA


class Loopback(Ulysses):
    """One rank of a group of ``size`` whose collectives return its own buffer: the real call's shapes."""

    def __init__(self, size: int):
        super().__init__(group=None, rank=size - 1, size=size)
        self.buffers: list[torch.Tensor] = []
        self.all_to_alls = 0

    def _all_to_all(self, out, send):
        assert out.is_contiguous() and send.is_contiguous() and out.shape == send.shape and out.device == send.device
        self.buffers.append(out)
        out.copy_(send)
        self.all_to_alls += 1

    def _all_gather(self, out, mine):
        assert out.is_contiguous() and mine.is_contiguous() and out.shape[0] == self.size * mine.shape[0]
        out.narrow(0, (self.size - 1) * mine.shape[0], mine.shape[0]).copy_(mine)


def _attention(fp8: bool):
    """diffusers' ``Cosmos3PackedMoTAttention`` on fake CUDA (built on meta, each parameter then a
    fake CUDA tensor: an initializer cannot run there); with ``fp8``, its eight projections static FP8."""
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3PackedMoTAttention

    with torch.device("meta"):
        attn = Cosmos3PackedMoTAttention(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, False, 1e-6)
    for module in attn.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fake = torch.empty_strided(param.shape, param.stride(), dtype=torch.bfloat16, device="cuda")
            setattr(module, name, nn.Parameter(fake, requires_grad=False))
    if fp8:
        for name in ("to_q", "to_k", "to_v", "to_out", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            old = getattr(attn, name)
            setattr(attn, name, Float8StaticLinear(old.in_features, old.out_features, False, torch.bfloat16, "cuda"))
    return attn


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(("size", "gen_rows"), [(2, 16), (2, 37), (4, 5)])
def test_a_ranks_pass_through_shard_attention_and_gather_keeps_cudas_rules(fp8, size, gen_rows):
    with fake_cuda() as rules, torch.device("cuda"):
        attn = _attention(fp8)
        sequence = Loopback(size)
        attn.set_processor(UlyssesCosmos3AttnProcessor(sequence))
        und = torch.empty(7, HIDDEN, dtype=torch.bfloat16)
        gen = torch.empty(gen_rows, HIDDEN, dtype=torch.bfloat16)
        rotary = tuple(torch.empty(n, HEAD_DIM, dtype=torch.bfloat16) for n in (7, 7, gen_rows, gen_rows))
        und, local, rotary = sequence.shard(und, gen, rotary)
        chunk = max(-(-gen_rows // size), min(gen_rows, 16))
        assert local.shape == (chunk, HIDDEN) and rotary[2].shape == (chunk, HEAD_DIM)
        with torch.no_grad():
            und_out, gen_out = attn(und, local, rotary)
        assert und_out.shape == (7, HIDDEN) and gen_out.shape == (chunk, HIDDEN)
        assert und_out.device.type == gen_out.device.type == "cuda"
        # q/k/v in one all-to-all, the output back in another; the buffers hold every head's share
        assert sequence.all_to_alls == 2
        assert sequence.buffers[0].shape == (size, chunk, (HEADS + 2 * max(KV_HEADS, size)) // size, HEAD_DIM)
        _, full = sequence.gather(und_out, gen_out)
        assert full.shape == (gen_rows, HIDDEN)
        assert rules.scaled_mm == (8 if fp8 else 0)  # every projection W8A8 on CUDA's layouts


def test_the_processor_hands_one_tensor_to_each_pathways_projections():
    seen: dict[str, list[int]] = {}
    with fake_cuda(), torch.device("cuda"):
        attn = _attention(fp8=False)
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            getattr(attn, name).register_forward_pre_hook(
                lambda m, a, n=name: seen.setdefault(n[:3], []).append(id(a[0]))
            )
        sequence = Loopback(2)
        attn.set_processor(UlyssesCosmos3AttnProcessor(sequence))
        rotary = tuple(torch.empty(n, HEAD_DIM, dtype=torch.bfloat16) for n in (3, 3, 16, 16))
        und, local, rotary = sequence.shard(
            torch.empty(3, HIDDEN, dtype=torch.bfloat16), torch.empty(20, HIDDEN, dtype=torch.bfloat16), rotary
        )
        with torch.no_grad():
            attn(und, local, rotary)
    assert len(set(seen["to_"])) == 1 and len(set(seen["add"])) == 1  # one input object per pathway


class _Batches(TorchDispatchMode):
    """The batch of every ``bmm`` (the attention's GEMMs on fake CUDA, which decomposes SDPA)."""

    def __init__(self):
        super().__init__()
        self.batches: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default:
            self.batches.add(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_a_one_head_share_runs_as_is_on_cuda():
    """The batch of two is CPU's rule (tests/unit/test_ulysses_attention.py); on CUDA one head runs once."""
    from fsdp_fp8.interop.ulysses import full_attention

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # where CPU would double the head
    try:
        with fake_cuda(), torch.device("cuda"):
            q = torch.empty(20, 1, HEAD_DIM, dtype=torch.bfloat16)
            kv = torch.empty(27, 1, HEAD_DIM, dtype=torch.bfloat16)
            with _Batches() as seen:
                out = full_attention(q, kv, kv)
            assert out.shape == (20, 1, HEAD_DIM) and out.device.type == "cuda"
    finally:
        torch.set_num_threads(before)
    assert seen.batches == {1}
