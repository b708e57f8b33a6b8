"""The per-step time forecast's FLOPs against torch's own FLOP counter on the real diffusers
``Cosmos3OmniTransformer``, and how a sequence group and a CFG pair split the work."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from fsdp_fp8.runtime.forecast import TransformerShape  # noqa: E402
from fsdp_fp8.runtime.parallel_layout import ParallelLayout  # noqa: E402
from fsdp_fp8.runtime.step_time import H200, layer_weights, pass_work, step_seconds  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=64,
)
SUPER = TransformerShape(5120, 25600, 64, 8, 128, 64, 16, 2)


def _counted_decoder_flops(text: int, frames: int) -> tuple[dict, TransformerShape, int]:
    """Per-op FLOPs torch counts inside the decoder layers of one forward (attention on SDPA's math
    path, which torch counts as matmuls), the shape, and the vision tokens."""
    from diffusers import Cosmos3OmniTransformer
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fsdp_fp8.interop.cosmos import pack_inputs

    model = Cosmos3OmniTransformer(**TINY).eval()
    ids = torch.randint(0, TINY["vocab_size"], (text,), generator=torch.Generator().manual_seed(0))
    latent = torch.randn(1, model.config.latent_channel, frames, 8, 8, generator=torch.Generator().manual_seed(1))
    kwargs = pack_inputs(model.config, ids, latent, 500.0)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**kwargs)
    total: dict[str, int] = {}
    for name, ops in counter.get_flop_counts().items():
        if name.rsplit(".", 2)[-2:-1] == ["layers"]:  # Cosmos3OmniTransformer.layers.<i>
            for op, n in ops.items():
                total[str(op)] = total.get(str(op), 0) + n
    return total, TransformerShape.from_config(dict(model.config)), kwargs["sequence_length"] - text


@pytest.mark.parametrize(("text", "frames"), [(7, 1), (11, 3)])
def test_the_forecast_flops_are_the_ones_torch_counts(text, frames):
    counted, shape, vision = _counted_decoder_flops(text, frames)
    work = pass_work(shape, text, vision)
    assert work.linear_flops == counted["aten.mm"]
    # SDPA's math path computes the causal text square whole; a flash kernel skips its masked half
    width = shape.heads * shape.head_dim
    assert work.attention_flops + 2 * text * text * width * shape.layers == counted["aten.bmm"]


def test_a_ulysses_group_splits_the_vision_work_and_keeps_the_text_whole():
    one, four = pass_work(SUPER, 512, 44160), pass_work(SUPER, 512, 44160, ulysses=4)
    text_linear = 2 * 512 * layer_weights(SUPER) * SUPER.layers
    assert four.linear_flops - text_linear == pytest.approx((one.linear_flops - text_linear) / 4)
    assert one.all_to_all_bytes == 0 < four.all_to_all_bytes
    assert four.attention_flops < one.attention_flops / 3.9  # the causal text part stays on every rank


def test_cfg_pairs_and_ulysses_groups_shorten_a_step_on_the_layouts_own_value():
    one = step_seconds(SUPER, 512, 44160, ParallelLayout(1), H200)
    fsdp = step_seconds(SUPER, 512, 44160, ParallelLayout(8), H200)
    both = step_seconds(SUPER, 512, 44160, ParallelLayout(8, cfg_parallel=True, ulysses=4), H200)
    assert fsdp == pytest.approx(one)  # FSDP alone: every rank computes the whole step
    assert one / both > 6  # the compute splits 8 ways; the all-to-alls cost the rest
