"""The launcher's reports: one dataclass per kind of run, each printing its own lines.

``Report`` holds what every run reports (where, how many ranks, the load, each rank's
figures); a subclass adds what its kind of run produced and the lines that show it.
``to_dict()`` is the ``--report`` JSON. No torch here: the runner fills these in.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field

from fsdp_fp8.generation.results import TaskResult

LABEL = 16  # the width of a line's label: "checkpoint      "
# Below this many bytes read, a rank's read rate says nothing about the storage: shown as "-".
MIN_RATE_BYTES = 2**20


def plural(count: int, noun: str, plural_noun: str | None = None) -> str:
    """``1 prompt``, ``2 prompts`` (``plural_noun`` where adding an s is wrong)."""
    return f"{count:,} {noun if count == 1 else (plural_noun or noun + 's')}"


def _line(label: str, text: str, width: int = 100) -> list[str]:
    """``label`` padded to the label column, ``text`` wrapped under it past ``width``."""
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=label.ljust(LABEL),
        subsequent_indent=" " * LABEL,
        break_on_hyphens=False,
        break_long_words=False,
    )


def _mib_or_dash(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class RankRow:
    """One rank's load, from its ``LoadReport``: bytes held and read, seconds, peak memory."""

    rank: int
    bytes_held: int
    bytes_read: int
    load_seconds: float  # this rank's load_model: plan, swap, shard, read (not the job's set-up)
    read_seconds: float
    read_gb_per_s: float
    peak_rss_bytes: int | None
    peak_device_bytes: int | None
    reads: str = ""  # how the rows were read (``LoadReport.reads``): O_DIRECT or the page cache, why

    @classmethod
    def from_load(cls, r) -> RankRow:
        return cls(
            rank=r.rank,
            bytes_held=r.bytes_held,
            bytes_read=r.bytes_read,
            load_seconds=round(r.seconds, 3),
            read_seconds=round(r.read_seconds, 3),
            read_gb_per_s=round(r.gb_per_s, 3),
            peak_rss_bytes=r.peak_rss_bytes,
            peak_device_bytes=r.peak_device_bytes,
            reads=getattr(r, "reads", ""),
        )

    def cells(self) -> str:
        rate = f"{self.read_gb_per_s:.2f}" if self.bytes_read >= MIN_RATE_BYTES else "-"
        return (
            f"{self.rank:>4}  {_mib_or_dash(self.bytes_held):>12}  {_mib_or_dash(self.bytes_read):>12}  {self.load_seconds:>7.2f}  "
            f"{self.read_seconds:>7.2f}  {rate:>6}  {_mib_or_dash(self.peak_rss_bytes):>12}  {_mib_or_dash(self.peak_device_bytes):>12}"
        )


RANK_HEADER = (
    f"{'rank':>4}  {'held':>12}  {'read':>12}  {'load s':>7}  {'read s':>7}  {'GB/s':>6}  {'peak RSS':>12}  "
    f"{'peak device':>12}"
)
RANK_NOTE = (
    "load s: the rank's own load_model (plan, shard, read its rows), part of the job's load above; "
    f"read s and GB/s: its file reads (GB/s shown from {_mib_or_dash(MIN_RATE_BYTES)} read)"
)


@dataclass(frozen=True)
class Quantized:
    """``--quantize``: what TorchAO quantized at load."""

    method: str
    linears: int
    weight_bytes_before: int
    weight_bytes_after: int

    def lines(self) -> list[str]:
        before, after = self.weight_bytes_before, self.weight_bytes_after
        return [
            f"quantized       {plural(self.linears, 'linear')} to {self.method} at load (TorchAO)",
            f"linear weights  {before:,} -> {after:,} bytes ({after / before:.2f}x)",
        ]


def hsdp_words(replicas: int, shard: int) -> str:
    """How every report names an HSDP mesh."""
    return f"HSDP {replicas} x {shard} (replicate x shard)"


def _hsdp_suffix(shape: list[int] | None) -> str:
    """The world-size line's suffix for a 2-D mesh ``shape``; nothing for a 1-D one."""
    if not shape or shape[0] == 1:
        return ""
    return f", {hsdp_words(shape[0], shape[1])}"


def _precision(trace: str | None, step_policy: str | None = None) -> str:
    if trace is None:
        return "high precision (no FP8 linear)"
    return trace if step_policy is None else f"{trace}  (step policy: {step_policy})"


def _residency_line(residency: dict) -> list[str]:
    blocks, resident = residency["blocks"], len(residency["resident"])
    if blocks == 0:
        return [f"resident        - (the model has no FSDP block below its root; --resident {residency['policy']})"]
    return [f"resident        {resident} of {plural(blocks, 'block')} ({residency['policy']})"]


@dataclass(kw_only=True)
class Report:
    """What every run reports; ``load_seconds`` is the whole job's, start to a model ready to run."""

    checkpoint: str
    world_size: int
    mesh: list[int]
    device: str
    fp8_linears: int
    quantize: Quantized | None = None
    load_seconds: float
    ranks: list[RankRow] = field(default_factory=list)
    torch: str = ""
    device_name: str = ""

    def body_lines(self) -> list[str]:
        """What this kind of run produced, as report lines (each subclass its own)."""
        raise NotImplementedError

    def set_no_fp8(self) -> None:
        """No FP8 linear at all: no precision trace (W8A8 / W8A16 would describe nothing)."""
        if hasattr(self, "precision_trace"):
            self.precision_trace = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def text(self) -> str:
        lines = [
            f"checkpoint      {self.checkpoint}",
            f"world size      {self.world_size} ({self.device}){_hsdp_suffix(self.mesh)}",
            f"FP8 linears     {self.fp8_linears}",
            *(self.quantize.lines() if self.quantize else []),
            *_line("load", f"{self.load_seconds:.2f} s for the job: open, build, shard, read, set up the model"),
            *(_line("reads", f"{self.ranks[0].reads} (rank 0)") if self.ranks and self.ranks[0].reads else []),
            *self.body_lines(),
            # What the digests above depend on besides checkpoint and options (docs/usage.md); one
            # line, whatever its length: scripts compare it whole.
            f"computed with   torch {self.torch} on {self.device}, {self.device_name}; digests compare only "
            "with runs on the same torch build and device model",
            "",
            RANK_HEADER,
            *(r.cells() for r in self.ranks),
            *textwrap.wrap(RANK_NOTE, width=100),
        ]
        return "\n".join(lines)


@dataclass(kw_only=True)
class MoTReport(Report):
    """The reference MoT: ``steps`` of our own sampler, with the all-gather bytes per step."""

    sample_seconds: float
    steps: int
    precision_trace: str | None
    step_policy: str
    latent_shape: list[int]
    latent_sha256: str
    residency: dict
    allgather_bytes_per_step: list[int]

    def body_lines(self) -> list[str]:
        per_step = self.allgather_bytes_per_step
        return [
            f"sampling        {plural(self.steps, 'step')} in {self.sample_seconds:.2f} s",
            f"precision       {_precision(self.precision_trace, self.step_policy)}",
            *_residency_line(self.residency),
            *_line(
                "all-gathered",
                f"{per_step[0]:,} B in step 1 (with the reasoner), {per_step[-1]:,} B per step after",
            ),
            f"latent          {tuple(self.latent_shape)} sha256 {self.latent_sha256}",
        ]


@dataclass(kw_only=True)
class TransformersReport(Report):
    """A transformers / diffusers model run once by ``fsdp_fp8.interop.hf_run``."""

    architecture: str
    kv_scales_unused: int
    run_seconds: float

    def model_line(self, what: str) -> str:
        unused = f", {plural(self.kv_scales_unused, 'KV-cache scale')} unused" if self.kv_scales_unused else ""
        return f"model           {self.architecture}{unused}, {what}"


@dataclass(kw_only=True)
class CausalLMReport(TransformersReport):
    prompt_ids: list[int]
    prompt_source: str
    generated_ids: list[int]
    logits_sha256: str

    def body_lines(self) -> list[str]:
        return [
            self.model_line(f"{plural(len(self.generated_ids), 'token')} generated"),
            *_line("prompt", f"{self.prompt_ids} ({self.prompt_source})"),
            *_line("generated", f"{self.generated_ids} in {self.run_seconds:.2f} s (greedy)"),
            f"logits          sha256 {self.logits_sha256}",
        ]


@dataclass(kw_only=True)
class DenoiserReport(TransformersReport):
    """A Cosmos 3 transformer alone: guided denoising steps on seeded latents."""

    prompt_source: str
    steps: int
    precision_trace: str | None
    latent_shape: list[int]
    latent_sha256: str

    def body_lines(self) -> list[str]:
        return [
            self.model_line(f"{plural(self.steps, 'step')} in {self.run_seconds:.2f} s"),
            f"precision       {_precision(self.precision_trace)}",
            f"latent          {tuple(self.latent_shape)} sha256 {self.latent_sha256}",
        ]


@dataclass(kw_only=True)
class ForwardReport(TransformersReport):
    """Any other diffusers transformer: one forward on seeded inputs."""

    output_shape: list[int]
    output_sha256: str

    def body_lines(self) -> list[str]:
        return [
            self.model_line(f"one forward in {self.run_seconds:.2f} s"),
            f"output          {tuple(self.output_shape)} sha256 {self.output_sha256}",
        ]


@dataclass(kw_only=True)
class PipelineReport(Report):
    """A diffusers pipeline root: every prompt generated by the pipeline's own loop."""

    pipeline: str
    steps: int
    sample_seconds: float
    residency: dict
    step_policy: str
    precision_trace: str | None
    latent_shape: list[int]
    latent_sha256: str
    outputs: list[TaskResult]  # one per prompt (fsdp_fp8.generation.results)
    cfg_parallel: bool = False  # the guidance passes ran on rank pairs (--cfg-parallel)
    parallelism: str = "none"  # the ranks of one request: "CFG 2 x Ulysses 4", "Ulysses 2", "CFG 2" or "none"
    mode: str = ""  # the requests' kinds: "image-to-video, 5 frames" (several: joined by " + ")

    def set_no_fp8(self) -> None:
        super().set_no_fp8()
        for row in self.outputs:
            row.precision_trace = None

    def to_dict(self) -> dict:
        rows, self.outputs = self.outputs, []  # the writer's rows hold its frames: not for asdict
        try:
            out = super().to_dict()
        finally:
            self.outputs = rows
        out["outputs"] = [row.to_dict() for row in rows]
        return out

    def body_lines(self) -> list[str]:
        lines = [
            *_line(
                "pipeline",
                f"{self.pipeline}, {self.mode + ', ' if self.mode else ''}{plural(len(self.outputs), 'prompt')}, "
                f"{plural(self.steps, 'step')} each, "
                f"in {self.sample_seconds:.2f} s"
                + (f", each request on {self.parallelism} ranks" if self.parallelism != "none" else ""),
            ),
            f"precision       {_precision(self.precision_trace, self.step_policy)}",
            *_residency_line(self.residency),
        ]
        for row in self.outputs:  # one line each, whatever its length: a digest is copied whole
            saved = f" -> {row.output}" if row.output else ""
            saved += f" (VAE decode {row.vae_decode})" if row.vae_decode else ""
            cached = f", step cache {row.step_cache.split(':')[0]}" if row.step_cache else ""
            lines.append(
                f"latent {row.index:>3}      {tuple(row.latent_shape)} sha256 {row.latent_sha256}"
                f" (rank {row.rank}{cached}){saved}"
            )
            if row.step_cache:
                lines.append(f"cache  {row.index:>3}      {row.step_cache}")
            if row.sound_sha256:
                lines.append(f"sound  {row.index:>3}      sha256 {row.sound_sha256}")
            if row.actions_sha256:
                shape = tuple(row.actions_shape or ())
                lines.append(f"actions {row.index:>2}      {shape} sha256 {row.actions_sha256}")
        return lines
