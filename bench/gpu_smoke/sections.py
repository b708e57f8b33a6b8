"""Every section by name, in the order the driver runs them, and how one runs in this process."""

from __future__ import annotations

from bench.gpu_smoke.attention import section_attention
from bench.gpu_smoke.collectives import section_allgather, section_alltoall
from bench.gpu_smoke.context import Context
from bench.gpu_smoke.decode import section_decode
from bench.gpu_smoke.demo import section_demo
from bench.gpu_smoke.gemm import section_gemm
from bench.gpu_smoke.gpu_tests import section_tests
from bench.gpu_smoke.load import section_load
from bench.gpu_smoke.preflight import section_preflight
from bench.gpu_smoke.step import section_step
from bench.gpu_smoke.versions import section_versions

SECTIONS = {
    "preflight": section_preflight,
    "versions": section_versions,
    "tests": section_tests,
    "gemm": section_gemm,
    "load": section_load,
    "step": section_step,
    "allgather": section_allgather,
    "alltoall": section_alltoall,
    "demo": section_demo,
    "attention": section_attention,
    "decode": section_decode,
}


def run_section(name: str, ctx: Context) -> None:
    """Run one section in this process (under fake CUDA when ``ctx.fake``)."""
    if ctx.fake:
        from bench.gpu_smoke.fake_cuda import fake_cuda

        with fake_cuda():
            SECTIONS[name](ctx)
    else:
        SECTIONS[name](ctx)
