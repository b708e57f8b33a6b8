"""The launcher's command line: every option in one table, parsed and checked before torch loads.

Nothing here imports torch (or anything that does): ``--help``, a usage error or an output
that cannot be written answers in a fraction of a second on rank 0, before a single weight is
read. Every problem found is reported together as one usage error (exit 2), printed once: by
rank 0 under torchrun; the other ranks wait for rank 0 to print it, then exit 2 silently (or are
ended by torchrun while they wait).
"""

from __future__ import annotations

import argparse
import os
import sys

from fsdp_fp8.cli import interrupts
from fsdp_fp8.cli.inputs import checkpoint_problems, pipeline_problems
from fsdp_fp8.cli.media import image_problems, video_problems
from fsdp_fp8.cli.options import EVERY_KIND, USES, file_problems, given_options, value_problems
from fsdp_fp8.cli.outputs import check_output, planned_outputs, read_prompts
from fsdp_fp8.errors import ProblemsError

DESCRIPTION = """\
Load a ModelOpt static-FP8 checkpoint sharded over the ranks and sample from it; rank 0
prints a report.

  torchrun --nproc-per-node N launch/infer.py [options]    (or: -m fsdp_fp8 run)
  fsdp-fp8 run --nproc-per-node N [options]                (starts the N ranks itself)

Without --checkpoint it runs the embedded demo (built and cached on first use). A
transformers causal LM generates --new-tokens greedily from --prompt-ids (or the prompt);
a diffusers transformer runs one forward on inputs drawn from --seed; a diffusers pipeline root
runs the pipeline."""

EPILOG = """\
Bounds (checked before anything loads): --steps 1..10000, --frames 1..1024, --height and
--width 1..16384 pixels, --fps above 0 and at most 1000, --latent-tokens 1..1000000,
--new-tokens 1..100000, --timeout above 0 and at most 86400 seconds, a prompt (--prompt,
--negative-prompt, a line of --prompts) at most 16384 bytes, the --prompts file at most 16 MiB.
An output file (--output, its per-prompt names, --report) must be a regular file, not another
of them, and is refused if it already exists unless --overwrite is given.

Exit status: 0 success, 1 a failure while loading or running (one "error:" line),
2 a usage error, 128 + N when ended by signal N (130 for Ctrl-C, 143 for SIGTERM)."""

RESIDENT_POLICIES = ("none", "auto", "all")  # fsdp_fp8.runtime.residency.POLICIES (a test holds them equal)
VAE_TILING = ("auto", "on", "off")  # runtime.vae_forecast.MODES, kept here to parse without torch
QUANTIZE_METHODS = ("fp8", "mxfp8", "nvfp4")  # fsdp_fp8.runtime.ptq.METHODS (likewise)
# diffusers' attention backend registry (interop.attention_backend.backend_names; a test holds them equal)
ATTENTION_BACKENDS = (
    "flash", "flash_hub", "flash_varlen", "flash_varlen_hub", "flash_4_hub", "_flash_3", "_flash_varlen_3",
    "_flash_3_hub", "_flash_3_varlen_hub", "aiter_fa2_hub", "flex", "native", "_native_cudnn", "_native_efficient",
    "_native_flash", "_native_math", "_native_npu", "_native_xla", "sage", "sage_hub", "sage_blackwell_hub",
    "sage_varlen", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton", "xformers",
)  # fmt: skip
DEFAULT_PROMPT = "a red fox jumps over a sleeping dog, golden hour"
DEFAULT_LATENT_TOKENS = 64


def _byte_count(text: str) -> int:
    units = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    units.update({"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12})
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].upper()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a byte count such as 60e9 or 48GiB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte count must be >= 0, got {text!r}")
    return int(value)


def _id_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


# (flags, argparse keywords), grouped as the help shows them. Another option goes in the group
# it belongs to; options.USES says which model kinds read it.
OPTIONS: dict[str, list[tuple[tuple[str, ...], dict]]] = {
    "what to run": [
        (("--checkpoint",), dict(help="ModelOpt static-FP8 checkpoint directory, pipeline root or hub repo id "
                                 "(default: the embedded demo)")),
        (("--nproc-per-node",), dict(type=int, metavar="N", help="start N ranks on this machine and report "
                                     "their outcome quietly: what torchrun --standalone does, without its failure report")),
        (("--steps",), dict(type=int, default=20, help="denoising steps (default 20)")),
        (("--seed",), dict(type=int, default=0, help="noise seed (default 0)")),
        (("--prompt",), dict(default=DEFAULT_PROMPT, help="prompt text (a pipeline's tokenizer, else its bytes "
                             "become token ids)")),
        (("--guidance",), dict(type=float, default=3.0, help="classifier-free guidance scale (default 3.0)")),
        (("--step-policy",), dict(choices=("auto", "off"), default="auto", help="auto: the checkpoint's "
                                  "diffusion step policy; off: every step W8A8")),
        (("--latent-tokens",), dict(type=int, default=DEFAULT_LATENT_TOKENS, help="reference MoT: latent "
                                    "tokens (default 64)")),
    ],
    "diffusers pipelines": [
        (("--prompts",), dict(metavar="FILE", help="one request per line (UTF-8, blank lines skipped): a prompt, or a JSON object "
                              "with \"prompt\" and optionally \"negative_prompt\", \"image\", \"video\", \"seed\"; request "
                              "group g of G (G = WORLD_SIZE without --cfg-parallel / --ulysses, else WORLD_SIZE "
                              "over the ranks of one request) generates requests g, g + G, g + 2G, ...")),
        (("--negative-prompt",), dict(default=None, help="the unconditional prompt (default empty)")),
        (("--output",), dict(metavar="FILE", help="save the decoded result as .png (an image, or an animated "
                             "PNG of the frames) or .mp4; with --prompts: FILE-000.png, FILE-001.png, ...")),
        (("--frames",), dict(type=int, help="frames to generate (1: an image; default: the demo's, else the "
                             "pipeline's)")),
        (("--height",), dict(type=int, help="height in pixels (default: the demo's, else the pipeline's)")),
        (("--width",), dict(type=int, help="width in pixels (default: the demo's, else the pipeline's)")),
        (("--attention-backend",), dict(choices=ATTENTION_BACKENDS, default="native", metavar="NAME",
                                        help="diffusers' attention backend for the transformer (default native: "
                                        "torch SDPA); one whose kernel is missing or cannot run on this device is "
                                        "refused before the load, naming those that can")),
        (("--safety-check",), dict(choices=("on", "off"), default="on", help="on (default): the pipeline's own "
                                   "guardrail runs where its model_index.json turns it on (Cosmos: the "
                                   "cosmos_guardrail package; missing, the run is refused before the load); off: "
                                   "loaded and run without it")),
        (("--vae-tiling",), dict(choices=VAE_TILING, default="auto", help="the VAE decode: on: "
                                 "diffusers' tiled decode, its tiles split over the ranks of a request (the "
                                 "frames of one rank's tiled decode, byte for byte); auto: tiled where the "
                                 "untiled decode's forecast exceeds the free device memory; off: the "
                                 "pipeline's own decode on the writing rank (default auto)")),
        (("--fps",), dict(type=float, default=24.0, help="frames per second: the prompt template and the mp4 "
                          "(default 24)")),
    ],
    "conditioning (diffusers pipelines; read by diffusers' load_image / load_video)": [
        (("--image",), dict(metavar="PATH", help="image-to-video: condition the first frame on this PNG, JPEG or "
                            "WebP image (at most 8192 x 8192 pixels; needs --frames above 1)")),
        (("--video",), dict(metavar="PATH", help="video-to-video: continue this clip (an mp4, an animated GIF or "
                            "PNG, or a directory of frames; at most 1024 frames)")),
        (("--condition-frames",), dict(type=_id_list, metavar="I,J", help="with --video: the latent frames "
                                       "kept clean (default: the pipeline's, 0,1)")),
        (("--sound",), dict(action="store_true", help="generate an audio track with the video, muxed into the "
                            ".mp4 --output (diffusers' encode_video, PyAV); needs a pipeline with a sound tokenizer")),
        (("--condition-keep",), dict(choices=("first", "last"), help="with --video: take the conditioning "
                                     "frames from its first or its last frames (default: the pipeline's, first)")),
    ],
    "causal language models": [
        (("--prompt-ids",), dict(type=_id_list, help="the prompt as token ids, e.g. 1,2,3")),
        (("--new-tokens",), dict(type=int, default=8, help="greedy tokens to generate (default 8)")),
    ],
    "sharding and memory": [
        (("--replicas",), dict(type=int, default=1, metavar="R", help="HSDP: shard within each of R replica "
                               "groups of WORLD_SIZE / R consecutive ranks (one node each, with torchrun's rank "
                               "order) and replicate across them (default 1: shard over every rank)")),
        (("--resident",), dict(choices=RESIDENT_POLICIES, default="none", help="FSDP2 blocks kept gathered "
                               "between forwards: none (re-gather each forward), auto (what --resident-budget "
                               "and the free device memory allow), all")),
        (("--resident-budget",), dict(type=_byte_count, metavar="BYTES", help="with --resident auto: the most "
                                      "the gathered blocks may take per rank (e.g. 60e9, 48GiB)")),
        (("--timeout",), dict(type=float, default=600.0, help="seconds before a stuck collective fails "
                              "(default 600)")),
        (("--ulysses", "--sequence-parallel"), dict(type=int, default=1, metavar="N", help="pipeline (Cosmos "
                                                    "3): Ulysses groups of N ranks split the generation tokens of "
                                                    "each pass (--sequence-parallel: its older name); N must divide "
                                                    "the query heads and divide the key/value heads or be a "
                                                    "multiple of them, and the ranks of a request (N, 2N with "
                                                    "--cfg-parallel) must divide the world size (default 1)")),
        (("--cfg-parallel",), dict(action="store_true", help="pipeline: ranks in pairs run the conditional "
                                   "and the unconditional pass of each step at once (needs an even world)")),
    ],
    "quantizing a high-precision checkpoint at load (one process)": [
        (("--quantize",), dict(choices=QUANTIZE_METHODS, help="quantize the linears with TorchAO at load")),
        (("--include",), dict(action="append", default=[], metavar="RE", help="only linears whose name "
                              "matches RE (re.search; repeatable)")),
        (("--exclude",), dict(action="append", default=[], metavar="RE", help="leave linears whose name "
                              "matches RE in high precision (repeatable)")),
    ],
    "reporting": [
        (("--report",), dict(metavar="PATH", help="also write the report as JSON (rank 0); its directory is "
                             "created if missing")),
        (("--overwrite",), dict(action="store_true", help="replace output files (--output, --report) that "
                                "already exist (default: refuse them before loading)")),
    ],
}  # fmt: skip


class RankZeroParser(argparse.ArgumentParser):
    """A usage error is printed once, by rank 0; under torchrun the other ranks wait for rank 0 to
    print it (``interrupts.wait_for_rank_0``), then exit 2 silently when torchrun did not end them
    first. A rank still running after that wait found an error rank 0 did not (a node-local
    ``--prompts`` file, a ``--report`` directory only its node lacks): it prints it, naming itself."""

    node_local = False  # the problems depend on this node's files (set by parse_run_args)

    def error(self, message: str):  # noqa: D401 - argparse's signature
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        elif interrupts.wait_for_rank_0() and self.node_local:
            print(f"{self.prog}: error (rank {rank}; rank 0 did not meet it): {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_run_parser(prog: str = "launch/infer.py") -> argparse.ArgumentParser:
    parser = RankZeroParser(
        prog=prog, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for title, options in OPTIONS.items():
        group = parser.add_argument_group(title)
        for flags, kwargs in options:
            group.add_argument(*flags, **kwargs)
    return parser


def parse_run_args(argv: list[str] | None = None, prog: str = "launch/infer.py") -> argparse.Namespace:
    """The launcher's options, every value checked, or one usage error (exit 2) naming every problem.

    Checked here, before anything is loaded: the value bounds, the checkpoint the path names (a
    directory holding one, a pipeline root, a hub name in the local cache) and the sizes its
    pipeline can make, every output file the run will write (its directory, a regular file, not
    another output, not an existing file without --overwrite), the prompts file (present, UTF-8
    text, not empty, bounded) and the combinations that cannot work.
    """
    parser = build_run_parser(prog)
    args = parser.parse_args(argv)  # its own errors (a bad type, an unknown option): alike on every rank
    parser.node_local = True  # from here on, every rank looks at its own node's files
    if args.report:  # its directory is made now, not after the whole run (documented)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        except OSError as exc:
            parser.error(f"--report {args.report}: cannot create its directory: {exc}")
    local = _file_problems(args)
    parser.node_local = bool(local)
    problems = _combination_problems(args) + value_problems(args) + local
    if problems:
        parser.error("; ".join(sorted(set(problems))))
    args.given = given_options(parser, args)
    return args


def _file_problems(args: argparse.Namespace) -> list[str]:
    """What this node's files say: the checkpoint and the sizes its pipeline can make, the
    prompts file, every output (checked on every rank: a node may lack what another has)."""
    problems = file_problems(args)
    root = None
    if args.checkpoint:
        root, found = checkpoint_problems("--checkpoint", args.checkpoint)
        problems += found
    if args.checkpoint is None or root is not None:
        problems += pipeline_problems(args, root)
    prompts = None
    if args.prompts is not None and os.path.isfile(args.prompts):
        try:
            prompts = read_prompts(args.prompts, args.prompt)
        except ValueError as exc:
            problems += exc.problems if isinstance(exc, ProblemsError) else [str(exc)]
    problems += _conditioning_problems(args, prompts or [])
    try:
        check_output(args.output, sound=args.sound)
    except ValueError as exc:
        problems += exc.problems if isinstance(exc, ProblemsError) else [str(exc)]
    else:
        problems += planned_outputs(args, len(prompts) if prompts is not None else 1)
    return problems


def _conditioning_problems(args: argparse.Namespace, prompts: list) -> list[str]:
    """The conditioning inputs, as this node's files have them, and their combinations: an image
    or a video per request (the pipeline takes one), condition options only with a video, and a
    video to generate (``--frames 1`` makes an image: the pipeline ignores the conditioning)."""
    problems = image_problems("--image", args.image) if args.image else []
    problems += video_problems("--video", args.video) if args.video else []
    requests = [("--image / --video", args.image, args.video)]
    for p in prompts:
        where = f"--prompts {args.prompts} line {p.line}"
        problems += image_problems(f'{where} "image"', p.image) if p.image else []
        problems += video_problems(f'{where} "video"', p.video) if p.video else []
        requests.append((where, p.image or args.image, p.video or args.video))
    for where, image, video in requests:
        if image and video:
            problems.append(f"{where}: an image and a video; the pipeline takes one (image- or video-to-video)")
    conditioned = any(image or video for _, image, video in requests)
    if (args.condition_frames is not None or args.condition_keep) and not any(v for _, _, v in requests):
        problems.append("--condition-frames / --condition-keep choose a --video's frames; give a --video too")
    if conditioned and args.frames == 1:
        problems.append("--frames 1 makes an image, and the pipeline ignores --image / --video for it; use 5 or more")
    elif (
        conditioned and args.frames is None and args.checkpoint is None and not (args.image or args.video or args.sound)
    ):
        problems.append(
            f"--prompts {args.prompts} conditions requests on images or videos, and the demo makes one "
            "image unless told otherwise: pass --frames 5 (or more)"
        )
    if args.sound and args.output and not args.output.lower().endswith(".mp4"):
        problems.append(f"--sound is muxed into a video file; --output {args.output} is no .mp4")
    return problems


def _combination_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if (args.include or args.exclude) and not args.quantize:
        problems.append("--include / --exclude select linears for --quantize; pass --quantize too")
    if args.resident_budget is not None and args.resident != "auto":
        problems.append("--resident-budget applies to --resident auto; pass that too")
    if args.prompts and args.quantize:
        problems.append("--prompts runs a pipeline; --quantize runs one process on a transformer")
    if args.attention_backend != "native":  # imports torch and diffusers: only when asked
        from fsdp_fp8.interop.attention_backend import backend_problems
        from fsdp_fp8.load.options import default_device

        problems += [f"--attention-backend: {p}" for p in backend_problems(args.attention_backend, default_device())]
    if args.nproc_per_node is not None and "RANK" in os.environ:
        problems.append("--nproc-per-node starts the ranks itself; under torchrun leave it out")
    return problems


__all__ = ["EVERY_KIND", "USES", "build_run_parser", "parse_run_args"]
