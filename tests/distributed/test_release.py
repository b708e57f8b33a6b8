"""Letting a loaded model go: ``LoadedModel.close()`` and ``with load_model(...) as loaded:``.

Memory is measured in the ranks' own processes: after a warm-up cycle (the first load and
forward page in library code and fill one-time caches), three cycles of load -> forward -> close
leave RSS less than one model's bytes above where it started, on one rank and on two, while
every closed ``LoadedModel`` is still referenced (as a pipeline references its transformer), so
nothing is left to the garbage collector.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from fake_cuda import FakeMeshModel as _Model
from fake_cuda import fake_cuda
from fake_cuda import gather_unsharded as _gather
from ranks import run_ranks
from small_models import uneven_model_fn, write_uneven_checkpoint

from fsdp_fp8.models import MoTConfig

MiB = 1 << 20
CYCLES = 3
# What three cycles leave besides any model's bytes: the three closed models' Python objects (kept
# referenced: ~1.2 MiB each here), page rounding and gloo's per-thread malloc arenas. Measured
# 4.5-6.2 MiB on a quiet 2-core machine and 12.5 MiB once in CI beside the rest of the suite
# (five cycles then). The bound is one model's bytes per rank (``held``: 38 MiB at 2 ranks): one
# cycle of the three that kept its bytes reaches it by itself.
LEFT_BY_THE_CYCLES_AT_MOST = 16 * MiB
# ~80 MiB of weights: the embedding and the BF16 head (31 MiB each) are the root's, which FSDP2
# keeps gathered after a forward, beside its own padded shard of them; each block is ~6 MiB.
CONFIG = MoTConfig(
    hidden_size=512,
    num_layers=2,
    num_heads=4,
    head_dim=128,
    intermediate_size=1536,
    vocab_size=32000,
    latent_channels=64,
)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint

    return write_sparse_checkpoint(CONFIG, tmp_path_factory.mktemp("release") / "ckpt")


def _rss() -> int:
    """Resident bytes, after the collector ran: cyclic garbage the loads' own steps leave (not the
    closed models: every one stays referenced) would otherwise come and go with its timing."""
    import gc
    import resource

    gc.collect()

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _fix_malloc_thresholds() -> None:
    """glibc's fixed thresholds instead of its moving ones (M_TRIM_THRESHOLD, M_MMAP_THRESHOLD:
    128 KiB). A forward under gloo allocates each all-gather's temporaries on gloo's worker
    threads, in their own malloc arenas, whose free top (up to 64 MiB each: glibc's dynamic trim
    threshold) neither ``free`` nor ``malloc_trim`` returns: memory the next forward reuses, not
    the model's. With fixed thresholds ``free`` returns it, and what stays is what is held."""
    libc = ctypes.CDLL(None)
    assert libc.mallopt(-1, 128 << 10) == 1 and libc.mallopt(-3, 128 << 10) == 1


def _w8a16(model: torch.nn.Module) -> None:
    """Every FP8 linear of ``model`` at W8A16. The forward is here for what FSDP2 and gloo leave
    behind (the root kept gathered, the all-gathers' temporaries), not for its arithmetic. W8A8's
    ``torch._scaled_mm`` is CPU's reference kernel: 4.3 s a forward of this model at one thread,
    and the two cycle tests took 57 s instead of ~8 s. The checkpoint has no step policy (which
    would choose per step), so the test sets the mode itself."""
    from fsdp_fp8.fp8.linear import Float8StaticLinear

    for module in model.modules():
        if isinstance(module, Float8StaticLinear):
            module.mode = "a16"


def _cycles(rank: int, world: int, path: str) -> dict:
    """RSS growth over ``CYCLES`` load -> close cycles, then over as many load -> forward -> close cycles;
    then what the last closed model answers to a forward and to ``save_checkpoint``."""
    from pathlib import Path

    from fsdp_fp8 import ExportError, ModelUnusableError, load_model, save_checkpoint

    latents, timestep = torch.zeros(1, 8, CONFIG.latent_channels), torch.tensor([0.5])
    dst = Path(path).parent / f"saved-at-{world}"
    kept = []  # every closed LoadedModel stays referenced: close() alone must free the bytes

    def cycle(forward: bool) -> int:
        with load_model(None, path, device=torch.device("cpu")) as loaded:
            if forward:  # FSDP2 then keeps the root gathered, beside its own padded shard
                _w8a16(loaded.model)
                with torch.no_grad():
                    loaded.model.denoise(latents, timestep, None)
        kept.append(loaded)
        return loaded.report.bytes_held

    cycle(forward=True)  # warm-up: library pages, lazy imports, the first forward's one-time caches
    growth = {}
    for forward in (False, True):
        if forward:
            _fix_malloc_thresholds()
        start = _rss()
        held = min(cycle(forward) for _ in range(CYCLES))
        growth["load, forward, close" if forward else "load, close"] = _rss() - start
    refused = []
    for attempt in (lambda: kept[-1].model.denoise(latents, timestep, None), lambda: save_checkpoint(kept[-1], dst)):
        try:
            attempt()
            refused.append("")
        except (ModelUnusableError, ExportError) as exc:
            refused.append(str(exc))
    return {"held": held, "growth": growth, "refused": refused, "saved": dst.exists()}


@pytest.mark.parametrize("world", [1, 2])
def test_rss_is_back_at_its_start_after_load_close_cycles(checkpoint_dir, world):
    results = run_ranks(_cycles, world, str(checkpoint_dir), timeout=300)
    for r in results:
        assert r["held"] > 2 * LEFT_BY_THE_CYCLES_AT_MOST  # a kept model stands out of the rest
        assert {k: v for k, v in r["growth"].items() if v >= r["held"]} == {}, (r["held"] / MiB, r["growth"])
        forward, save = r["refused"]
        assert "this model was closed and must not be used" in forward, forward
        assert "this model was closed and must not be saved" in save and not r["saved"], save


def test_a_closed_model_refuses_to_run_and_to_be_saved_and_closes_twice(tmp_path):
    from fsdp_fp8 import ExportError, ModelUnusableError, load_model, save_checkpoint

    loaded = load_model(uneven_model_fn, write_uneven_checkpoint(tmp_path / "src"), device=torch.device("cpu"))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    loaded.model(x)
    weight = loaded.model.layers[0].up.weight
    loaded.close()
    loaded.close()  # nothing left to do
    assert [weight.qdata.untyped_storage().nbytes(), weight.scale.untyped_storage().nbytes()] == [0, 0]
    assert all(h.closed for h in loaded.checkpoint.handles.values())
    for call in (loaded.model, loaded.model.forward, loaded.model.layers[1], loaded.model.layers[1].up.forward):
        with pytest.raises(ModelUnusableError, match=r"this model was closed .*LoadedModel\.close\(\)"):
            call(x)
    with pytest.raises(ExportError, match="this model was closed and must not be saved"):
        save_checkpoint(loaded, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_leaving_the_with_block_closes_also_on_an_error(tmp_path):
    from fsdp_fp8 import ModelUnusableError, load_model

    path = write_uneven_checkpoint(tmp_path / "src")
    with pytest.raises(KeyError, match="inside"):
        with load_model(uneven_model_fn, path, device=torch.device("cpu")) as loaded:
            before = loaded.model.head.weight.untyped_storage().nbytes()
            raise KeyError("inside")
    assert (before, loaded.model.head.weight.untyped_storage().nbytes()) == (6 * 16 * 2, 0)
    with pytest.raises(ModelUnusableError, match="was closed"):
        loaded.model(torch.randn(1, 16, dtype=torch.bfloat16))


def test_a_pipeline_lets_its_transformer_go_while_it_still_holds_it(demo_root):
    """``loaded_of(pipe).close()``: the transformer's bytes go although ``pipe.transformer`` still
    references it; the components diffusers loaded are the pipeline's and stay as they are."""
    pytest.importorskip("diffusers")
    from fsdp_fp8 import ModelUnusableError, denoising_step, load_pipeline, loaded_of
    from fsdp_fp8.collective.unusable import storage_tensors
    from fsdp_fp8.interop.cosmos import seeded_inputs

    pipe = load_pipeline(demo_root, device=torch.device("cpu"))
    model = pipe.transformer
    inputs = seeded_inputs(model.config, torch.bfloat16, torch.Generator().manual_seed(0))

    def nbytes(module) -> int:
        tensors = [*module.parameters(), *module.buffers()]
        return sum(t.untyped_storage().nbytes() for p in tensors for t in storage_tensors(p) if not t.is_meta)

    with torch.no_grad(), denoising_step(model, 0, 8):
        model(**inputs)
    held, vae = nbytes(model), nbytes(pipe.vae)
    loaded_of(pipe).close()
    assert pipe.transformer is model
    assert (held > 0, nbytes(model), nbytes(pipe.vae)) == (True, 0, vae)
    with torch.no_grad(), denoising_step(model, 0, 8), pytest.raises(ModelUnusableError, match="was closed"):
        model(**inputs)


def test_release_on_a_fake_cuda_mesh_frees_every_fsdp_storage_of_a_gathered_block(fake_rank):
    """The CUDA path (FakeTensorMode, torch's fake process group, rank 1 of 3): a block left
    gathered, as FSDP2 leaves the root after a forward, holds its shards and its gathered weights;
    ``release_model`` frees both, and FSDP2's padded shards, on the fake device."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_fp8 import ModelUnusableError
    from fsdp_fp8.collective.unusable import storage_tensors
    from fsdp_fp8.load.release import release_model

    mesh = fake_rank(1, 3)
    with fake_cuda():
        model = _Model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        group = model.blocks[0]._get_fsdp_state()._fsdp_param_group
        group.lazy_init()
        group._init_mp_dtypes()
        _gather(group.fsdp_params, mesh.get_group())  # gathered, and not resharded

        def held() -> dict[str, int]:
            tensors = {}
            for i, p in enumerate(group.fsdp_params):
                tensors |= {f"{i} shard": p._sharded_param_data, f"{i} gathered": p._unsharded_param}
                tensors |= {f"{i} all-gather {j}": t for j, t in enumerate(p.all_gather_outputs)}
            return {k: sum(s.untyped_storage().nbytes() for s in storage_tensors(t)) for k, t in tensors.items()}

        before = held()
        assert release_model(model) and not release_model(model)
        with pytest.raises(ModelUnusableError, match="was closed"):
            model.blocks[0].up(torch.empty(2, 32, dtype=torch.bfloat16, device="cuda"))
    assert all(before.values()) and held() == dict.fromkeys(before, 0), (before, held())
