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
import textwrap

from fsdp_fp8.cli import interrupts
from fsdp_fp8.cli.outputs import check_output, planned_outputs, writable_file
from fsdp_fp8.errors import ProblemsError
from fsdp_fp8.format.handles import broken_link
from fsdp_fp8.format.timeouts import MAX_TIMEOUT_S
from fsdp_fp8.generation.checks import conditioning_problems, value_problems
from fsdp_fp8.generation.declare import bounds_text, declared, flags_of, reference_rows, take
from fsdp_fp8.generation.inputs import checkpoint_problems, pipeline_problems
from fsdp_fp8.generation.prompts import MAX_PROMPT_BYTES, MAX_PROMPTS_FILE_BYTES, read_prompts
from fsdp_fp8.generation.values import GROUPS, VALUE_CLASSES, GenerationRequest, Job, RunSettings

DESCRIPTION = """\
Load a ModelOpt static-FP8 checkpoint sharded over the ranks and sample from it; rank 0
prints a report.

  torchrun --nproc-per-node N launch/infer.py [options]    (or: -m fsdp_fp8 run)
  fsdp-fp8 run --nproc-per-node N [options]                (starts the N ranks itself)

Without --checkpoint it runs the embedded demo (built and cached on first use). A
transformers causal LM generates --new-tokens greedily from --prompt-ids (or the prompt);
a diffusers transformer runs one forward on inputs drawn from --seed; a diffusers pipeline root
runs the pipeline."""


def epilog(classes: tuple[type, ...] = VALUE_CLASSES) -> str:
    """``--help``'s closing text; its bounds made from the declarations (``generation.values``)."""
    bounds = (
        f"Bounds (checked before anything loads): {bounds_text(*classes)}, --timeout above 0 and at most "
        f"{MAX_TIMEOUT_S:,.0f} seconds; a prompt (--prompt, --negative-prompt, a line of --prompts) at most "
        f"{MAX_PROMPT_BYTES:,} bytes, the --prompts file at most {MAX_PROMPTS_FILE_BYTES >> 20} MiB. An output "
        "file (--output, its per-prompt names, --report) must be a regular file, not another of them, and is "
        "refused if it already exists unless --overwrite is given."
    )
    return f"""\
{textwrap.fill(bounds, width=92)}

Exit status: 0 success, 1 a failure while loading or running (one "error:" line),
2 a usage error, 128 + N when ended by signal N (130 for Ctrl-C, 143 for SIGTERM)."""


def integer(text: str) -> int:
    """``12`` -> 12 (every option declared ``type=int``): argparse's own words would be "invalid int value"."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def token_ids(text: str) -> list[int]:
    """``1,2,3`` -> ``[1, 2, 3]`` (``--prompt-ids``)."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def frame_indexes(text: str) -> list[int]:
    """``0,1`` -> ``[0, 1]`` (``--condition-frames``)."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated latent frame indexes (integers such as 0,1), got {text!r}"
        ) from None


def byte_count(text: str) -> int:
    """``60e9``, ``48GiB`` -> bytes (``--resident-budget``)."""
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


# The declarations' named text parsers (``type="token_ids"``): command-line spellings only
TEXT_PARSERS = {"token_ids": token_ids, "frame_indexes": frame_indexes, "byte_count": byte_count}


def _tupled(value):
    return tuple(value) if isinstance(value, list) else value


def job_of(args: argparse.Namespace) -> Job:
    """The frozen values of parsed (and checked) arguments; the one place a ``Namespace`` is read."""
    return Job(
        request=GenerationRequest(**take(GenerationRequest, args, _tupled)),
        settings=RunSettings(**take(RunSettings, args, _tupled)),
        given=frozenset(getattr(args, "given", ())),
    )


def option_reference(classes: tuple[type, ...] = VALUE_CLASSES) -> str:
    """The launcher's options as the markdown tables of docs/usage.md's reference, one per
    ``--help`` group, made from the declarations (a test holds the doc equal to it)."""
    lines = []
    rows = reference_rows(*classes)
    for title in GROUPS:
        mine = [row for row in rows if row[0] == title]
        if not mine:
            continue
        lines += [f"**{title[0].upper()}{title[1:]}**", "", "| option | default | what it does |", "|---|---|---|"]
        lines += [f"| {flags} | {default} | {text.replace('|', '&#124;')} |" for _, flags, default, text in mine]
        lines.append("")
    return "\n".join(lines)


def add_option(parser_or_group, name: str, classes: tuple[type, ...] = VALUE_CLASSES, note: str = "") -> None:
    """Add the declared option ``name`` (``generation.values``) to a parser or group, as declared;
    ``note`` before its help (another command's use of it: ``forecast: ``)."""
    for field_name, field, meta in declared(*classes):
        if field_name == name:
            default = list(field.default) if isinstance(field.default, tuple) else field.default
            keywords = dict(meta.cli)
            if isinstance(keywords.get("type"), str):
                keywords["type"] = TEXT_PARSERS[keywords["type"]]
            elif keywords.get("type") is int:
                keywords["type"] = integer
            parser_or_group.add_argument(
                *flags_of(name, meta), dest=name, default=default, help=note + meta.help, **keywords
            )
            return
    raise KeyError(name)


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


def build_run_parser(
    prog: str = "launch/infer.py", classes: tuple[type, ...] = VALUE_CLASSES
) -> argparse.ArgumentParser:
    """The launcher's parser, one argument per declared field of ``classes``, grouped as
    ``GROUPS`` orders them."""
    parser = RankZeroParser(
        prog=prog, description=DESCRIPTION, epilog=epilog(classes), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    options = declared(*classes)
    for title in GROUPS:
        group = parser.add_argument_group(title)
        for name, _, meta in options:
            if meta.group == title:
                add_option(group, name, classes)
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
    args.given = given_options(parser, args)  # before the checks: a distilled root's take what was given
    local = _file_problems(args)
    parser.node_local = bool(local)
    problems = _combination_problems(args) + value_problems(args) + local
    if problems:
        parser.error("; ".join(sorted(set(problems))))
    return args


def given_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> set[str]:
    """The options set to something other than their default."""
    return {
        a.dest
        for a in parser._actions
        if a.dest != argparse.SUPPRESS and a.dest != "help" and getattr(args, a.dest, a.default) != a.default
    }


def file_problems(args: argparse.Namespace) -> list[str]:
    """The ``--report`` file and the ``--prompts`` file, as this node's filesystem has them
    (``--output``: ``outputs.planned_outputs``; sorted)."""
    problems = []
    if getattr(args, "report", None) is not None:
        problems += writable_file("--report", args.report, getattr(args, "overwrite", False))
    prompts = getattr(args, "prompts", None)
    if prompts is not None and (link := broken_link(prompts)):
        problems.append(f"--prompts {prompts} is {link}")
    elif prompts is not None and not os.path.exists(prompts):
        problems.append(f"--prompts {prompts}: no such file")
    elif prompts is not None and not os.path.isfile(prompts):
        problems.append(f"--prompts {prompts} is not a regular file (a directory, pipe or device); name a text file")
    return sorted(problems)


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
    problems += conditioning_problems(args, prompts or [])
    try:
        check_output(args.output, sound=args.sound)
    except ValueError as exc:
        problems += exc.problems if isinstance(exc, ProblemsError) else [str(exc)]
    else:
        problems += planned_outputs(args, len(prompts) if prompts is not None else 1)
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


__all__ = ["add_option", "build_run_parser", "job_of", "option_reference", "parse_run_args"]
