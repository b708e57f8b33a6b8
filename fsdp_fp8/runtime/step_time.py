"""Time per denoising step of a Cosmos 3 transformer, forecast from FLOPs and bytes alone.

A pass's work comes from the transformer's shape (``forecast.TransformerShape``): the decoder
linears' FLOPs and attention's; a step runs two passes under guidance. The ``ParallelLayout``
splits it: CFG-parallel gives each rank one pass, Ulysses ``1/S`` of the vision tokens and heads.

A pass takes ``max(compute, all-gather) + all-to-all``: FSDP2's all-gathers overlap the compute,
Ulysses' all-to-alls do not. Compute runs at an assumed fraction of the GPU's dense peak
(:data:`MFU`), collectives at an assumed fraction of NVLink (:data:`LINK_EFFICIENCY`).
Assumptions, not measurements.

Figures and formulas: docs/cosmos3.md, "Parallel layouts: memory and time per step (forecast)".
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_fp8.runtime.forecast import TransformerShape
from fsdp_fp8.runtime.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class Gpu:
    name: str
    fp8_tflops: float  # dense peak, W8A8 steps
    bf16_tflops: float  # dense peak, W8A16 steps and attention
    link_gb_s: float  # NVLink bandwidth per direction per GPU


# NVIDIA's data sheets (SXM, dense, no sparsity): H100 and H200 share the compute (one figure
# serves both; they differ in memory); NVLink 4 carries 900 GB/s in both directions together,
# 450 GB/s each way.
H200 = Gpu("H200 SXM", 1979.0, 989.0, 450.0)
MFU = 0.5  # the fraction of peak a large GEMM or flash-attention kernel sustains (assumed)
LINK_EFFICIENCY = 0.7  # of NVLink bandwidth an NCCL all-gather / all-to-all sustains (assumed)


@dataclass(frozen=True)
class PassWork:
    """One transformer forward over ``text`` + ``vision`` tokens, on one rank."""

    linear_flops: float
    attention_flops: float
    all_gather_bytes: float  # FP8 weights this rank receives
    all_to_all_bytes: float  # what this rank sends (and receives) in Ulysses' all-to-alls


def layer_weights(shape: TransformerShape) -> int:
    """Weights of one tower's linears in one decoder layer (q, k, v, out; gate, up, down)."""
    attention = shape.hidden * (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return attention + 3 * shape.hidden * shape.intermediate


def pass_work(shape: TransformerShape, text: int, vision: int, ulysses: int = 1, gpus: int = 1) -> PassWork:
    """The FLOPs and bytes of one pass on one rank of a Ulysses group of ``ulysses``, the weights
    sharded over ``gpus``."""
    s = ulysses
    per_layer = layer_weights(shape)
    linear = 2 * (vision / s + text) * per_layer * shape.layers
    width = shape.heads * shape.head_dim
    gen_attention = 4 * vision * (text + vision) * width / s
    text_attention = 2 * text * text * width  # causal: half of the square
    weights = 2 * per_layer * shape.layers  # both towers, FP8: one byte each
    qkv_out = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim * shape.dtype_bytes
    all_to_all = (vision / s) * qkv_out * (s - 1) / s * shape.layers
    return PassWork(linear, (gen_attention + text_attention) * shape.layers, weights * (gpus - 1) / gpus, all_to_all)


def step_seconds(
    shape: TransformerShape, text: int, vision: int, layout: ParallelLayout, gpu: Gpu, w8a8: bool = True
) -> float:
    """Forecast seconds of one denoising step (two guidance passes) on ``layout``'s GPUs (its
    ``world``; the weights sharded over its ``shard`` dim)."""
    work = pass_work(shape, text, vision, layout.ulysses, layout.shard)
    linear_tflops = gpu.fp8_tflops if w8a8 else gpu.bf16_tflops
    compute = work.linear_flops / (linear_tflops * 1e12 * MFU) + work.attention_flops / (gpu.bf16_tflops * 1e12 * MFU)
    link = gpu.link_gb_s * 1e9 * LINK_EFFICIENCY
    one_pass = max(compute, work.all_gather_bytes / link) + work.all_to_all_bytes / link
    return one_pass * (1 if layout.cfg_parallel else 2)
