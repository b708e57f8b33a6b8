"""The reference MoT through the whole product at 2 ranks: export -> load -> gather round
trip, and the step policy wired to the right tower at every step."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from small_models import load_files

from fsdp_fp8.export.modelopt import export_fp8
from fsdp_fp8.format.step_policy import PUBLISHED_POLICY
from fsdp_fp8.models import PRESETS, build_model, init_weights
from fsdp_fp8.runtime.sampler import sample

# Reasoner native, generation W8A16 on the first 2 and last 1 steps: swapping the towers'
# roles changes what each linear must run as.
POLICY = {
    **PUBLISHED_POLICY,
    "first_steps": {"count": 2, "mode": "a16"},
    "last_steps": {"count": 1, "mode": "a16"},
    "reasoner": "native",
}
STEPS = 5


def _calibrate(model):
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    sample(model, ids, steps=2, seed=0, num_latent_tokens=5)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = init_weights(build_model(PRESETS["tiny"], device="cpu"), seed=0)
    return export_fp8(
        model,
        tmp_path_factory.mktemp("mot") / "ckpt",
        config=model.config.to_config_dict(),
        calibrate=_calibrate,
        step_policy=POLICY,
        max_shard_size=60_000,
        scales_in_separate_shard=True,
    )


def _wiring_problems(calls, towers, policy) -> list[str]:
    """Each recorded (phase, step, linear, mode) against what the policy says."""
    problems = []
    for phase, step, name, mode in calls:
        tower = towers[name]
        if tower == "reasoner":
            want = policy.reasoner_precision
        elif tower == "generation":
            want = policy.precision(step, STEPS)
        else:
            want = "native"
        if mode != want:
            problems.append(f"{phase} step {step}: {name} ({tower}) ran {mode}, policy says {want}")
    return problems


def _load_and_sample(rank, world, path):
    from fsdp_fp8 import Float8StaticLinear, gather_state_dict, load_model
    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.format.step_policy import parse_step_policy
    from fsdp_fp8.fp8.shared_inputs import share_quantized_inputs
    from fsdp_fp8.interop.architectures import resolve_model_spec
    from fsdp_fp8.models import linear_towers
    from fsdp_fp8.runtime.precision import denoising_step, install_step_policy

    arch = resolve_model_spec(open_checkpoint(path).config)
    loaded = load_model(arch.model_fn, path)
    model = loaded.model
    gathered = gather_state_dict(model)
    towers = linear_towers(model)
    policy = parse_step_policy(loaded.checkpoint.quant.step_policy)
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(1))

    def run(tower_map):
        install_step_policy(model, policy, tower_map)
        calls, where = [], {"phase": "reason", "step": -1}
        hooks = [
            m.register_forward_pre_hook(
                lambda mod, args, n=n: calls.append((where["phase"], where["step"], n, mod.mode))
            )
            for n, m in model.named_modules()
            if isinstance(m, Float8StaticLinear)
        ]

        def step_context(i, n):
            where.update(phase="denoise", step=i)
            return denoising_step(model, i, n)

        latent = sample(model, ids, steps=STEPS, seed=3, num_latent_tokens=5, step_context=step_context)
        for h in hooks:
            h.remove()
        return latent, calls

    latent, calls = run(towers)
    swapped = {n: {"reasoner": "generation", "generation": "reasoner"}.get(t, t) for n, t in towers.items()}
    _, calls_swapped = run(swapped)
    shared, separate = share_quantized_inputs(model)
    return {
        "gathered": gathered if rank == 0 else None,
        "latent": latent,
        "problems": _wiring_problems(calls, towers, policy),
        "problems_if_swapped": _wiring_problems(calls_swapped, towers, policy),
        "towers_called": sorted({towers[n] for _, _, n, _ in calls}),
        "shared_groups": len(shared),
        "separate_groups": separate,
    }


@pytest.fixture(scope="module")
def observed(exported):
    return run_ranks(_load_and_sample, 2, str(exported), timeout=180)


def test_export_load_gather_round_trip_is_bit_exact(observed, exported):
    files = load_files(exported)
    gathered = observed[0]["gathered"]
    assert set(gathered) == set(files)
    for key, value in files.items():
        got = gathered[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key


def test_generation_tower_follows_the_step_and_reasoner_the_policy(observed):
    for obs in observed:
        assert obs["towers_called"] == ["generation", "reasoner"]
        assert obs["problems"] == []
        # The same check catches a routing that swaps the towers' roles.
        assert len(obs["problems_if_swapped"]) > 0
    assert torch.equal(observed[0]["latent"], observed[1]["latent"])


def test_sibling_projections_share_their_quantized_input(observed):
    # Per layer: reasoner q/k/v, generation q/k/v, two gate/up pairs; the exporter
    # calibrates siblings on the same input, so their input scales are equal.
    assert observed[0]["shared_groups"] == 4 * PRESETS["tiny"].num_layers
    assert observed[0]["separate_groups"] == []
