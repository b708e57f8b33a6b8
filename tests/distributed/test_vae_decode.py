"""The split VAE decode: the ranks of a request decode disjoint tiles, the writer blends them, and
its frames equal diffusers' own ``enable_tiling()`` decode on one rank, byte for byte.

Two VAEs: the embedded demo's (``AutoencoderKLWan``, spatial 4, no patch) and a Wan 2.2-shaped one
with random weights (48 latent channels, patch size 2, spatial 16, residual blocks), both with
small tiles so that a small latent makes several tiles of different sizes. One 4-rank spawn runs
everything distributed: two pairs (2-rank splits) and then the four ranks (4-rank splits, one case
with fewer tiles than ranks), a refusal when the ranks' latents differ, and a rank whose decode
fails. Each writer's reference is ``vae.decode`` in its own process.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from pipelines import DEMO_TILES, WAN22_CONFIG, WAN22_TILES  # noqa: E402
from ranks import run_ranks  # noqa: E402

from fsdp_fp8.interop.vae_decode import RequestDecode, assign_tiles, tile_plan  # noqa: E402

# A Wan 2.2 VAE with narrow layers (fsdp_fp8.testing.wan22_vae), zero mean and unit spread.
DEMO_LATENT = (1, 4, 2, 7, 5)  # 3 x 2 tiles, heights 4 4 1, widths 4 2
WAN22_LATENT = (1, 48, 2, 5, 3)  # 2 x 1 tiles: at 4 ranks two ranks decode none


def _vae(name: str, demo_root: str):
    from diffusers import AutoencoderKLWan

    if name == "demo":
        vae = AutoencoderKLWan.from_pretrained(f"{demo_root}/vae").eval()
        vae.enable_tiling(*DEMO_TILES)
        return vae, DEMO_LATENT
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**WAN22_CONFIG).eval()
    vae.enable_tiling(*WAN22_TILES)
    return vae, WAN22_LATENT


def _latent(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def _split(vae, shape, ranks: list[int], rank: int):
    """The split decode over ``ranks`` (a new group: every rank makes it), and on its writer
    whether the frames equal ``vae.decode`` here, byte for byte."""
    import torch.distributed as dist

    group = dist.new_group(ranks=ranks)
    if rank not in ranks:
        return None
    decode = RequestDecode(group, ranks.index(rank), len(ranks))
    z = _latent(shape)
    with torch.no_grad():
        out = decode.decode(vae, z)
        if out is None:
            return {"writer": False, "sent": decode.sent_bytes}
        ref = vae.decode(z).sample
    return {"writer": True, "equal": torch.equal(out, ref), "shape": tuple(out.shape), "ref_shape": tuple(ref.shape)}


def _refusals(vae, shape, rank: int) -> dict:
    """Rank 1 holds a latent one frame longer, then rank 3 one whose first element differs: every
    rank refuses alike. Then rank 2's decoder is gone: every rank raises, none hangs in a send."""
    import torch.distributed as dist

    group, seen = dist.group.WORLD, {}
    decode = RequestDecode(group, rank, dist.get_world_size())
    odd = list(shape)
    odd[2] += rank == 1
    other = _latent(shape)
    other.view(-1)[0] += rank == 3
    for case, z, vae_here in (
        ("differ", _latent(tuple(odd)), vae),
        ("values", other, vae),
        ("fails", _latent(shape), _broken(vae) if rank == 2 else vae),
    ):
        try:
            decode.decode(vae_here, z)
            seen[case] = "passed"
        except (ValueError, RuntimeError) as exc:
            seen[case] = f"{type(exc).__name__}: {exc}"
    return seen


def _broken(vae):
    import copy

    broken = copy.deepcopy(vae)
    del broken.decoder
    return broken


def _everything(rank: int, world: int, demo_root: str) -> dict:
    vaes = {name: _vae(name, demo_root) for name in ("demo", "wan22")}
    out = {"pairs": {}, "four": {}}
    for ranks, which in (([0, 1], "demo"), ([2, 3], "wan22")):  # every rank makes both groups
        got = _split(*vaes[which], ranks, rank)
        if got is not None:
            out["pairs"][which] = got
    for which in ("demo", "wan22"):
        out["four"][which] = _split(*vaes[which], list(range(world)), rank)
    out["refusals"] = _refusals(*vaes["demo"], rank)
    return out


@pytest.fixture(scope="module")
def four_ranks(demo_root):
    return run_ranks(_everything, 4, str(demo_root), timeout=800)


@pytest.mark.parametrize("name", ["demo", "wan22"])
def test_split_over_two_ranks_equals_the_one_rank_tiled_decode(four_ranks, name):
    writer = four_ranks[0 if name == "demo" else 2]["pairs"][name]
    other = four_ranks[1 if name == "demo" else 3]["pairs"][name]
    assert writer["writer"] and writer["equal"], writer
    assert writer["shape"] == writer["ref_shape"]
    assert other == {"writer": False, "sent": other["sent"]} and other["sent"] > 0  # its tiles went, it holds none


@pytest.mark.parametrize("name", ["demo", "wan22"])
def test_split_over_four_ranks_equals_the_one_rank_tiled_decode(four_ranks, name):
    writer = four_ranks[0]["four"][name]
    assert writer["writer"] and writer["equal"], writer
    sent = [four_ranks[r]["four"][name]["sent"] for r in (1, 2, 3)]
    if name == "wan22":  # 2 tiles over 4 ranks: two ranks decode nothing and send nothing
        assert sorted(s > 0 for s in sent) == [False, False, True]
    else:
        assert all(s > 0 for s in sent)


def test_ranks_that_disagree_or_fail_all_raise(four_ranks):
    differ = [four_ranks[r]["refusals"]["differ"] for r in range(4)]
    assert len(set(differ)) == 1 and differ[0].startswith("ArgumentError") and "['frames', 'latent sum']" in differ[0]
    values = [four_ranks[r]["refusals"]["values"] for r in range(4)]
    assert len(set(values)) == 1 and values[0].startswith("ArgumentError") and "in ['latent sum']" in values[0]
    fails = [four_ranks[r]["refusals"]["fails"] for r in range(4)]
    assert all(f.startswith("RuntimeError") and "failed on rank(s) [2]" in f for f in fails), fails
    assert "decoder" in fails[2]  # the failing rank names its own error


def test_tiles_are_shared_out_disjoint_and_balanced_by_size():
    costs = [16, 8, 16, 8, 4, 2]  # the demo latent's six tiles (latent pixels)
    for ranks in (1, 2, 3, 4, 8):
        owned = assign_tiles(costs, ranks)
        flat = sorted(i for tiles in owned for i in tiles)
        assert flat == list(range(len(costs)))
        loads = [sum(costs[i] for i in tiles) for tiles in owned]
        assert max(loads) - min(loads) <= max(costs)  # greedy, largest first: within one tile
    assert [sum(costs[i] for i in t) for t in assign_tiles(costs, 2)] == [28, 26]  # 16 8 4 | 16 8 2


def test_the_plan_is_diffusers_own_tiling():
    """The seams relied on exist with the meaning used (guarded end to end by the tests above)."""
    from diffusers import AutoencoderKLWan

    for name in ("clear_cache", "blend_v", "blend_h", "tiled_decode", "enable_tiling"):
        assert callable(getattr(AutoencoderKLWan, name)), name
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**WAN22_CONFIG)
    vae.enable_tiling(*WAN22_TILES)
    vae.clear_cache()  # makes the causal caches decode_tile hands to the decoder
    for attr in ("_feat_map", "_conv_idx", "use_slicing", "tile_sample_min_height", "tile_sample_stride_width"):
        assert hasattr(vae, attr), attr
    plan = tile_plan(vae, (1, 48, 2, 7, 10))
    assert (plan.starts_h, plan.starts_w, plan.tile_h, plan.stride_h, plan.blend_h) == (
        (0, 3, 6),
        (0, 3, 6, 9),
        4,
        24,
        8,
    )


@pytest.mark.parametrize("slicing", [False, True], ids=["batch whole", "use_slicing"])
def test_a_batch_of_two_tiles_as_decode_does_sliced_or_whole(slicing):
    """One process: every tile of the plan decoded and blended here equals ``vae.decode`` byte for
    byte, with ``use_slicing`` (each batch item its own tiled decode) and without."""
    from fsdp_fp8.interop.vae_decode import blend_tiles, decode_tile

    vae, _ = _vae("wan22", "")
    vae.use_slicing = slicing
    shape = (2, 48, 1, 5, 3)
    z = _latent(shape)
    plan = tile_plan(vae, shape)
    assert len(plan.tiles) == (4 if slicing else 2)
    with torch.no_grad():
        out = blend_tiles(vae, plan, {t: decode_tile(vae, z, plan, t) for t in plan.tiles})
        assert torch.equal(out, vae.decode(z).sample)
