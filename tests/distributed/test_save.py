"""save_checkpoint: a sharded model written back as a ModelOpt checkpoint without gathering it.

One spawn per world size loads and saves every source (process start-up dominates on CPU);
the tests below judge what the ranks observed. Sources: the real ModelOpt export with FP8
KV-cache scales (which the transformers Llama has no tensor for: they must be carried over),
the embedded demo's Cosmos 3 transformer (sharded, with a step policy), and a model whose row counts do not divide
by 2 or 3 (one linear has fewer rows than ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_writer import raw_tensors
from ranks import run_ranks
from small_models import uneven_model_fn, write_uneven_checkpoint

KV_FIXTURE = Path(__file__).parents[1] / "fixtures" / "modelopt-0.47-llama-fp8-kv"
WORLD_SIZES = (1, 2, 3)


class _NewStorage(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every tensor an op creates with storage of its own (views and in-place ops excluded)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and not a.is_meta
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _local_bytes(model) -> int:
    from fsdp_fp8.load.meta_build import storage_tensors

    return sum(
        i.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()] for i in storage_tensors(t)
    )


def _load_and_save(rank, world, sources: dict[str, str], out: str) -> dict:
    from fsdp_fp8 import load_model, save_checkpoint

    observed = {}
    for name, path in sources.items():
        loaded = load_model(uneven_model_fn if name == "uneven" else None, path, device=torch.device("cpu"))
        counter = _NewStorage()
        with counter:
            report = save_checkpoint(loaded, Path(out) / name, max_shard_size=100_000 if name == "demo" else None)
        observed[name] = {
            "new_bytes": counter.bytes,
            "largest_new": counter.largest,
            "local_bytes": _local_bytes(loaded.model),
            "written": report.bytes_written,
            "path": str(report.directory),
        }
    return observed


@pytest.fixture(scope="module")
def sources(tmp_path_factory, demo_root):
    root = tmp_path_factory.mktemp("sources")
    # The demo is a diffusers pipeline: its FP8 transformer is what is loaded and saved.
    return {
        "kv": str(KV_FIXTURE),
        "demo": str(demo_root / "transformer"),
        "uneven": str(write_uneven_checkpoint(root / "uneven")),
    }


@pytest.fixture(scope="module")
def saved(sources, tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            out = tmp_path_factory.mktemp(f"saved{world}")
            cache[world] = (out, run_ranks(_load_and_save, world, sources, str(out), timeout=240))
        return cache[world]

    return get


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", ["kv", "demo", "uneven"])
def test_load_then_save_is_byte_identical_to_the_source(saved, sources, world, name):
    out, _ = saved(world)
    source, copy = raw_tensors(sources[name]), raw_tensors(out / name)
    assert sorted(copy) == sorted(source)
    changed = [k for k in source if copy[k] != source[k]]
    assert not changed, changed[:5]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_saved_checkpoints_keep_the_quantization_config_and_load_back(saved, sources, world):
    from fsdp_fp8 import open_checkpoint

    out, _ = saved(world)
    for name in sources:
        src, dst = open_checkpoint(sources[name]), open_checkpoint(out / name)
        assert dst.quant.step_policy == src.quant.step_policy, name
        assert dst.quant.kv_cache_quant_algo == src.quant.kv_cache_quant_algo, name
        assert set(dst.quant.ignore) == set(src.quant.ignore), name
        assert sorted(dst.kv_scales) == sorted(src.kv_scales), name
        assert sorted(dst.fp8_modules) == sorted(src.fp8_modules), name
        assert dst.quant.producer.startswith("fsdp_fp8 "), name
        assert {k: v for k, v in dst.config.items() if k != "quantization_config"} == {
            k: v for k, v in src.config.items() if k != "quantization_config"
        }, name
    kv = open_checkpoint(out / "kv")
    assert kv.kv_scales and kv.quant.kv_cache_quant_algo == "FP8"
    assert open_checkpoint(out / "demo").quant.step_policy is not None
    assert len(open_checkpoint(out / "demo").files) > 1  # max_shard_size honoured


@pytest.mark.parametrize("world", (2, 3))
def test_each_rank_writes_only_its_rows_and_allocates_no_copy(saved, sources, world):
    _, observed = saved(world)
    one = saved(1)[1][0]
    for name in sources:
        written = [observed[r][name]["written"] for r in range(world)]
        # every byte of data is written exactly once, by all ranks together
        assert sum(written) == one[name]["written"], (name, written)
        for rank in range(world):
            seen = observed[rank][name]
            # No rank holds more than its shard plus a small bounded buffer: the model's
            # bytes are written from the local storage, nothing is gathered or copied.
            assert seen["new_bytes"] < 1 << 20, (name, rank, seen)
            assert seen["written"] <= seen["local_bytes"] + 4096, (name, rank, seen)
        assert max(written) < one[name]["written"], (name, written)  # nobody wrote it all


def test_nothing_is_left_next_to_the_saved_checkpoints(saved):
    for world in WORLD_SIZES:
        out, _ = saved(world)
        assert sorted(p.name for p in out.iterdir()) == ["demo", "kv", "uneven"]


# --- failures: agreed, and no half-written checkpoint -----------------------------------


def _save_failing(rank, world, source: str, out: str, case: str) -> tuple[str, str]:
    from fsdp_fp8 import load_model, save_checkpoint
    from fsdp_fp8.format import writer

    loaded = load_model(uneven_model_fn, source, device=torch.device("cpu"))
    kwargs = {}
    if case == "write fails on rank 1" and rank == 1:

        def broken(self, key, offset, data):
            raise OSError(f"injected write failure for `{key}`")

        writer.ShardWriter.write = broken
    if case == "ranks disagree" and rank == 1:
        kwargs["max_shard_size"] = 100
    try:
        save_checkpoint(loaded, out, **kwargs)
    except Exception as exc:  # noqa: BLE001 - judged by the test
        return type(exc).__name__, str(exc)
    return "ok", ""


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize(
    "case, needle",
    [
        ("write fails on rank 1", "rank 1: OSError: injected write failure for `"),
        ("ranks disagree", "ranks disagree on the planned files: `layout digest` differs"),
    ],
)
def test_a_failure_on_one_rank_fails_every_rank_and_leaves_nothing(tmp_path, world, case, needle):
    source = write_uneven_checkpoint(tmp_path / "src")
    out = tmp_path / "out" / "ckpt"
    results = run_ranks(_save_failing, world, str(source), str(out), case, timeout=120)
    assert all(kind == "ExportError" for kind, _ in results), results
    assert all(needle in text for _, text in results), results
    assert len({text for _, text in results}) == 1  # the same error on every rank
    assert not out.exists() and list(out.parent.iterdir()) == []  # the temporary directory is gone too


def test_refuses_a_non_empty_target_before_writing(tmp_path):
    from fsdp_fp8 import ExportError, load_model, save_checkpoint

    loaded = load_model(uneven_model_fn, write_uneven_checkpoint(tmp_path / "src"), device=torch.device("cpu"))
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not an empty directory"):
        save_checkpoint(loaded, tmp_path / "dst")
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_a_model_whose_load_failed_is_refused(tmp_path):
    from fsdp_fp8 import ExportError, save_checkpoint
    from fsdp_fp8.collective.unusable import UNUSABLE

    model = uneven_model_fn({})
    UNUSABLE.set(model, "rank 1: injected")
    with pytest.raises(ExportError, match="did not finish loading"):
        save_checkpoint(model, tmp_path / "dst", config={})
    assert not (tmp_path / "dst").exists()


# --- runtime PTQ: a TorchAO-quantized model saves to a checkpoint that loads back ----------


def _ptq_model(tmp_path):
    import dataclasses

    from fsdp_fp8 import export_bf16, load_model
    from fsdp_fp8.models import PRESETS, build_model, init_weights

    config = dataclasses.replace(PRESETS["tiny"], intermediate_size=96, latent_channels=16, vocab_size=112)
    model = init_weights(build_model(config, device="cpu"), seed=0)
    export_bf16(model, tmp_path / "bf16", config=config.to_config_dict())
    return load_model(None, tmp_path / "bf16", device=torch.device("cpu"))


def _calibrate(model):
    from fsdp_fp8.runtime.sampler import sample

    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    sample(model, ids, steps=2, seed=0, num_latent_tokens=5)


def test_a_ptq_model_saves_and_loads_back_with_the_same_codes(tmp_path):
    from fsdp_fp8 import Float8StaticLinear, load_model, quantize_model, save_checkpoint
    from fsdp_fp8.export.modelopt import calibrate_input_scales

    loaded = _ptq_model(tmp_path)
    names = quantize_model(
        loaded.model, "fp8", granularity="per_tensor", exclude=r"^(proj_in|proj_out|time_embedder|lm_head)\b"
    )
    scales = calibrate_input_scales(loaded.model, names, _calibrate)
    save_checkpoint(loaded, tmp_path / "fp8", input_scales=scales)
    back = load_model(None, tmp_path / "fp8", device=torch.device("cpu"))
    assert sorted(back.fp8_linears) == sorted(names)
    for name in names:
        ptq = loaded.model.get_submodule(name).weight
        fp8 = back.model.get_submodule(name)
        assert isinstance(fp8, Float8StaticLinear)
        assert torch.equal(fp8.weight.qdata.view(torch.uint8), ptq.qdata.view(torch.uint8)), name
        assert torch.equal(fp8.weight.scale.reshape(()), ptq.scale.reshape(())), name
        assert torch.equal(fp8.weight.act_quant_scale.reshape(()), scales[name]), name
    assert back.checkpoint.quant.is_modelopt_fp8
    assert "lm_head" in back.checkpoint.quant.ignore and "layers.0.mlp.up_proj" not in back.checkpoint.quant.ignore


def test_a_ptq_model_without_static_scales_or_per_row_is_refused(tmp_path):
    from fsdp_fp8 import ExportError, quantize_model, save_checkpoint

    loaded = _ptq_model(tmp_path)
    quantize_model(loaded.model, "fp8", granularity="per_row", include=r"layers\.0\.mlp")
    quantize_model(loaded.model, "fp8", granularity="per_tensor", include=r"layers\.1\.mlp")
    with pytest.raises(ExportError) as info:
        save_checkpoint(loaded, tmp_path / "out")
    text = str(info.value)
    assert "`layers.0.mlp.up_proj.weight` is a TorchAO Float8Tensor with 96 scales" in text, text
    assert "granularity='per_tensor'" in text
    assert "`layers.1.mlp.up_proj` quantizes its input dynamically; pass its static input scale" in text
    assert not (tmp_path / "out").exists()


# --- the CLI ----------------------------------------------------------------------------------


def test_cli_save_writes_a_checkpoint_verify_accepts(tmp_path, capsys):
    from fsdp_fp8.cli.commands import main

    source = write_uneven_checkpoint(tmp_path / "src")
    assert main(["save", str(KV_FIXTURE), str(tmp_path / "kv"), "--max-shard-size", "20000"]) == 0
    out = capsys.readouterr().out
    assert f"saved {tmp_path / 'kv'}" in out
    assert raw_tensors(tmp_path / "kv") == raw_tensors(KV_FIXTURE)
    assert main(["verify", str(tmp_path / "kv")]) == 0
    assert main(["save", str(KV_FIXTURE), str(source)]) == 1  # not empty: refused
    assert "exists and is not an empty directory" in capsys.readouterr().err


def _save_with_a_dead_peer(rank, world, source: str, out: str, record: str) -> None:
    import os
    import pickle

    from fsdp_fp8 import load_model, save_checkpoint

    loaded = load_model(uneven_model_fn, source, device=torch.device("cpu"))
    if rank == 1:
        os._exit(17)  # dies between the load and the save's first agreement
    try:
        save_checkpoint(loaded, out)
        result = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - judged by the test
        result = (type(exc).__name__, str(exc))
    Path(record).write_bytes(pickle.dumps(result))


def test_a_lost_peer_is_a_peer_lost_error_and_leaves_nothing(tmp_path, monkeypatch):
    import pickle

    import ranks
    from ranks import RanksFailed

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 30.0)  # rank 0 must be allowed to report
    source = write_uneven_checkpoint(tmp_path / "src")
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(RanksFailed, match="rank 1 exited with code 17"):
        run_ranks(
            _save_with_a_dead_peer, 2, str(source), str(out), str(tmp_path / "rank0.pkl"), timeout=120, pg_timeout=20
        )
    kind, text = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    assert kind == "PeerLostError", (kind, text)
    # On the agreements' gloo side group, which names the rank that never arrived.
    assert "rank 0 could not complete the agreement on the planned files with the other ranks" in text, text
    assert "rank(s) [1] left before arriving" in text or "rank(s) [1] did not arrive" in text, text
    assert not out.exists() and list(out.parent.iterdir()) == []
