"""The flow-matching Euler sampler with classifier-free guidance."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from fsdp_fp8.models import PRESETS, build_model, init_weights
from fsdp_fp8.runtime.sampler import sample

TINY32 = dataclasses.replace(PRESETS["tiny"], dtype="float32")


def tiny(config=TINY32):
    return init_weights(build_model(config, device="cpu"), seed=0)


def prompt():
    return torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))


def test_matches_a_hand_written_euler_cfg_loop():
    model = tiny()
    steps, guidance, n = 3, 2.5, 4
    out = sample(model, prompt(), steps=steps, seed=7, guidance=guidance, num_latent_tokens=n)
    with torch.no_grad():
        x = torch.randn(2, n, 6, generator=torch.Generator().manual_seed(7))
        state = model.reason(prompt())
        ts = torch.linspace(1.0, 0.0, steps + 1).tolist()  # t: 1 -> 0, linear
        for i in range(steps):
            t = torch.full((2,), ts[i])
            v_cond, v_uncond = model.denoise(x, t, state), model.denoise(x, t, None)
            x = x + (ts[i + 1] - ts[i]) * (v_uncond + guidance * (v_cond - v_uncond))
    assert torch.equal(out, x)


def test_deterministic_from_seed_and_in_model_dtype():
    model = tiny(PRESETS["tiny"])
    a = sample(model, prompt(), steps=2, seed=1, num_latent_tokens=3)
    b = sample(model, prompt(), steps=2, seed=1, num_latent_tokens=3)
    c = sample(model, prompt(), steps=2, seed=2, num_latent_tokens=3)
    assert a.dtype == torch.bfloat16 and a.shape == (2, 3, 6)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_step_context_wraps_both_guidance_passes_and_progress_is_reported():
    model = tiny()
    events: list[tuple] = []
    original = model.denoise

    def denoise(x, t, state):
        events.append(("denoise", state is not None))
        return original(x, t, state)

    model.denoise = denoise

    @contextlib.contextmanager
    def step_context(i, n):
        events.append(("enter", i, n))
        yield
        events.append(("exit", i, n))

    sample(
        model,
        prompt(),
        steps=3,
        seed=0,
        num_latent_tokens=2,
        step_context=step_context,
        on_step=lambda i, n: events.append(("step", i, n)),
    )
    per_step = lambda i: [
        ("enter", i, 3),
        ("denoise", True),
        ("denoise", False),  # noqa: E731
        ("exit", i, 3),
        ("step", i, 3),
    ]
    assert events == per_step(0) + per_step(1) + per_step(2)


def test_rejects_zero_steps():
    with pytest.raises(ValueError, match="steps"):
        sample(tiny(), prompt(), steps=0, seed=0, num_latent_tokens=2)
