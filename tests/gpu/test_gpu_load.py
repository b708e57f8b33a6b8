"""CUDA + NCCL at world size 1: the loaded FP8 model holds the checkpoint's bytes on the GPU,
runs W8A8 through the real ``torch._scaled_mm`` kernel, and its forward matches the CPU
reference. Skipped without CUDA or below compute capability 8.9 (no FP8 tensor cores)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with compute capability >= 8.9 (FP8)",
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from fsdp_fp8.testing.mot_checkpoint import write_mot_checkpoint

    return write_mot_checkpoint(tmp_path_factory.mktemp("mot") / "ckpt")


def _inputs(model, device):
    from fsdp_fp8.testing.mot_checkpoint import mot_prompt_ids as demo_prompt_ids

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, model.config.latent_channels, generator=gen).to(device, torch.bfloat16)
    return demo_prompt_ids().to(device), x, torch.full((1,), 0.5, device=device)


@torch.no_grad()
def _forward(model, device, mode):
    from fsdp_fp8 import Float8StaticLinear

    for m in model.modules():
        if isinstance(m, Float8StaticLinear):
            m.mode = mode
    prompt, x, t = _inputs(model, device)
    state = model.reason(prompt)
    return model.denoise(x, t, state).float().cpu()


@pytest.fixture(scope="module")
def cpu_reference(demo):
    from fsdp_fp8 import load_model
    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.interop.architectures import resolve_model_spec

    model = load_model(
        resolve_model_spec(open_checkpoint(demo).config).model_fn, demo, device=torch.device("cpu")
    ).model
    return {mode: _forward(model, torch.device("cpu"), mode) for mode in ("native", "a16")}


@pytest.fixture(scope="module")
def nccl_world_1(tmp_path_factory):
    import torch.distributed as dist

    store = (tmp_path_factory.mktemp("nccl") / "store").as_uri()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_nccl_world_1_load_forward_matches_cpu_and_uses_scaled_mm(demo, cpu_reference, nccl_world_1, monkeypatch):
    from safetensors.torch import load_file

    from fsdp_fp8 import gather_state_dict, load_model
    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.interop.architectures import resolve_model_spec

    device = torch.device("cuda", 0)
    loaded = load_model(resolve_model_spec(open_checkpoint(demo).config).model_fn, demo, device=device)
    model = loaded.model
    assert loaded.report.peak_device_bytes is not None

    # Every byte of the checkpoint is on the GPU as it is in the files.
    files = {}
    for path in sorted(demo.glob("*.safetensors")):
        files.update(load_file(path))
    gathered = gather_state_dict(model)
    assert sorted(gathered) == sorted(files)
    for key, value in files.items():
        assert torch.equal(gathered[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key

    calls = []
    real = torch._scaled_mm

    def spy(a, b, *args, **kwargs):
        calls.append((a.device.type, a.dtype, b.dtype))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    w8a8 = _forward(model, device, "native")
    assert calls and all(c == ("cuda", torch.float8_e4m3fn, torch.float8_e4m3fn) for c in calls)
    calls.clear()
    w8a16 = _forward(model, device, "a16")
    assert not calls  # W8A16 dequantizes: no FP8 GEMM

    # Same codes and scales, same activation quantization; the GEMM's accumulation order
    # differs between the CPU and CUDA kernels, and after four layers a BF16 rounding flip
    # can move an activation across an E4M3 step in the next layer's quantization. An
    # elementwise bound would then flake on a few outliers; the relative norm of the whole
    # output does not, and a wrong scale or layout is O(1) in it.
    for got, want in ((w8a8, cpu_reference["native"]), (w8a16, cpu_reference["a16"])):
        assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert not torch.equal(w8a8, w8a16)  # the two precisions really differ


def _mesh(n):
    return type("Mesh", (), {"size": lambda self: n})()


@pytest.mark.parametrize(("world", "rows"), [(3, 4), (8, 7)])  # each with a zero-row rank
def test_uint8_all_gather_through_nccl_rebuilds_the_codes(nccl_world_1, world, rows):
    """The hooks' payload through a real NCCL all-gather (one rank here, so each simulated
    rank's shard goes through the collective in turn) gives back the full E4M3 codes."""
    import torch.distributed as dist

    from fsdp_fp8.fp8.tensor import E4M3, make_static_fp8_weight, rebuild
    from fsdp_fp8.runtime.allgather_meter import all_gather_into

    device = torch.device("cuda", 0)
    codes = (torch.randn(rows, 32, generator=torch.Generator().manual_seed(world)) * 40).to(E4M3).to(device)
    full = make_static_fp8_weight(
        codes, torch.tensor(0.01, device=device), torch.tensor(0.02, device=device), torch.bfloat16
    )
    chunks = list(torch.chunk(codes, world)) + [codes[:0]] * world
    gathered = []
    for chunk in chunks[:world]:
        (payload,), meta = rebuild(full, chunk.contiguous()).fsdp_pre_all_gather(
            _mesh(world), full.shape, full.stride(), None, None
        )
        assert payload.dtype == torch.uint8 and payload.is_cuda
        out = torch.empty_like(payload)
        all_gather_into(out, payload, group=dist.group.WORLD)
        gathered.append(out)
    unsharded, _ = full.fsdp_post_all_gather((torch.cat(gathered),), meta, torch.bfloat16)
    assert torch.equal(unsharded.qdata.view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one GPU")
def test_the_demo_on_every_gpu_equals_one_gpu(tmp_path):
    """The demo under NCCL at min(8, GPU count) ranks samples the latent one GPU samples."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    digests = []
    for n in (1, min(torch.cuda.device_count(), 8)):
        report = tmp_path / f"r{n}.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            str(root / "launch" / "infer.py"),
            "--steps",
            "4",
            "--report",
            str(report),
        ]
        proc = subprocess.run(cmd, cwd=root, env=dict(os.environ), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests.append(json.loads(report.read_text())["latent_sha256"])
    assert digests[0] == digests[1]
