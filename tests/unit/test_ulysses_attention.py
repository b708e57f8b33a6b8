"""A Ulysses rank's share of the generation attention gives one rank's bits for its heads, on CPU
with several threads, when that share is one head of a short pass (interop.ulysses.full_attention).

torch's CPU SDPA kernel runs the GEMMs of each (batch, head, query block) on one thread when a
call has several such items, and multi-threaded when it has a single one; the two round apart now
and then (one bfloat16 row in a few percent of the calls below, on this project's machine). One
rank's call holds every head; a rank of the ModelOpt fixture's transformer (2 query heads, 1
key-value head) under Ulysses 2 holds one, and 32 generation rows make one query block.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

ROWS, KEYS, HEAD_DIM = 32, 229, 16  # the fixture at 5 frames: 32 generation rows, 197 text keys
SEEDS = range(120)


@pytest.fixture
def two_threads():
    """torch on two threads for the test (the kernel's choice depends on more than one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _pass(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two query heads and one key-value head, (rows, heads, dim), as the fixture's layers make them."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(ROWS, 2, HEAD_DIM, generator=g) * 3).to(torch.bfloat16)
    k = (torch.randn(KEYS, 1, HEAD_DIM, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(KEYS, 1, HEAD_DIM, generator=g).to(torch.bfloat16)
    return q, k, v


def _one_rank(q, k, v) -> torch.Tensor:
    """diffusers' processor's call: every head at once."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(q[None], k[None], v[None], is_causal=False, enable_gqa=True)[0]


def test_a_rank_holding_one_head_gets_that_heads_bits_of_the_one_rank_call(two_threads):
    from fsdp_fp8.interop.ulysses import full_attention

    differ = []
    for seed in SEEDS:
        q, k, v = _pass(seed)
        one = _one_rank(q, k, v)
        for head in (0, 1):
            if not torch.equal(full_attention(q.narrow(1, head, 1), k, v), one.narrow(1, head, 1)):
                differ.append((seed, head))
    assert differ == []


def test_a_share_of_several_heads_is_the_plain_call(two_threads):
    from fsdp_fp8.interop.ulysses import full_attention

    q, k, v = _pass(0)
    assert torch.equal(full_attention(q, k, v), _one_rank(q, k, v))
    assert full_attention(q.narrow(1, 1, 1), k, v).shape == (ROWS, 1, HEAD_DIM)
