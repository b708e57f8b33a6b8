"""``meta_init`` is scoped: to its block (nothing of torch stays patched after it) and to its
thread (another thread building a model meanwhile gets real, initialized parameters)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from fsdp_fp8.load.meta_build import meta_init


def test_nothing_stays_patched_after_the_block():
    register, normal, kaiming = nn.Module.register_parameter, nn.init.normal_, nn.init.kaiming_uniform_
    with meta_init():
        inside = nn.Linear(4, 4)
        assert nn.Module.register_parameter is not register  # (the block is in effect)
    assert inside.weight.is_meta
    assert nn.Module.register_parameter is register
    assert nn.init.normal_ is normal and nn.init.kaiming_uniform_ is kaiming
    assert not nn.Linear(4, 4).weight.is_meta


def test_another_thread_building_meanwhile_gets_real_initialized_parameters():
    entered, built = threading.Event(), threading.Event()
    out = {}

    def on_meta():
        with meta_init():
            entered.set()
            assert built.wait(30)  # stays inside while the other thread builds
            out["meta"] = nn.Linear(8, 8)
            out["meta_buffer"] = nn.BatchNorm1d(8).running_mean

    thread = threading.Thread(target=on_meta)
    thread.start()
    assert entered.wait(30)
    torch.manual_seed(0)
    real = nn.Linear(8, 8)  # this thread is not in a meta_init block
    built.set()
    thread.join(30)
    assert not real.weight.is_meta and real.weight.abs().sum() > 0  # initialized, not skipped
    torch.manual_seed(0)
    assert torch.equal(real.weight, nn.Linear(8, 8).weight)  # exactly nn.Linear's own init
    assert out["meta"].weight.is_meta and not out["meta_buffer"].is_meta  # buffers stay real


def test_transformers_own_initializers_are_skipped_on_meta(monkeypatch):
    """transformers calls the copies of the ``nn.init`` initializers it took at import
    (``TORCH_INIT_FUNCTIONS``): inside the block those are skipped too, and put back after it."""
    transformers = pytest.importorskip("transformers")
    init = pytest.importorskip("transformers.initialization")
    calls = []
    original = init.TORCH_INIT_FUNCTIONS["normal_"]

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    monkeypatch.setitem(init.TORCH_INIT_FUNCTIONS, "normal_", counting)
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    with meta_init():
        model = transformers.LlamaForCausalLM._from_config(config)
    assert all(p.is_meta for p in model.parameters())
    assert calls == []
    assert init.TORCH_INIT_FUNCTIONS["normal_"] is counting  # the table is as it was
    transformers.LlamaForCausalLM._from_config(config)  # outside the block: transformers' init runs
    assert calls
