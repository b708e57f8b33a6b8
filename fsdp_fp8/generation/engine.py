"""The generation engine: many requests over a loaded pipeline's request groups, one library call
under the launcher, the server and the Python API alike (docs/design.md, "The engine").

    engine = Engine(pipe, settings)        residency once, the split VAE decode's group
    engine.generate(tasks_of(request))     rounds: request group g of G runs tasks g, g + G, ...
      per round, on every rank:
        read the task's conditioning   -> pipe(...)   -> decode (split over the request's ranks)
        the request gate's meeting at the first forward, a StepMeeting at every step's end,
        the round's end meeting (generation.meetings): failures, cancels, progress, results
    -> one TaskResult per task, the same on every rank (frames and sound on the writer)

FSDP is data-parallel: every forward all-gathers each layer from every rank, so every request
group runs as many forwards as the others. A group without a task of its own in a round runs a
padding copy of the round's first task (latents only, discarded). Outputs are written by the
first rank of the group that made them, atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import logging
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.compose.pipeline import loaded_of, pipeline_name, work_of
from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format.step_policy import describe_trace
from fsdp_fp8.generation.actions import read_actions
from fsdp_fp8.generation.media import load_conditioning_image, load_conditioning_video
from fsdp_fp8.generation.meetings import RoundEnd, StepMeeting, StepNote, meet_at_end
from fsdp_fp8.generation.prompts import read_prompts
from fsdp_fp8.generation.results import CANCELLED, FAILED, PhaseSeconds, TaskResult, actions_paths, output_path
from fsdp_fp8.generation.values import GenerationRequest, Prompt, RunSettings
from fsdp_fp8.interop.diffusers_pipeline import distilled_problems, distilled_steps, is_modular
from fsdp_fp8.interop.forward_state import state_of
from fsdp_fp8.interop.modular import call_modular
from fsdp_fp8.interop.request_agreement import RequestAbortedError, RequestMismatchError, library_class, request_gate
from fsdp_fp8.interop.vae_decode import decode_request, decode_video, request_decode
from fsdp_fp8.runtime.precision import routing_of
from fsdp_fp8.runtime.residency import apply_residency

log = logging.getLogger("fsdp_fp8")

# How a result begins whose request failed only because another request of its round did (the
# server runs it again).
STOPPED_WITH_ROUND = "stopped with its round: "


@dataclass(frozen=True)
class Task:
    """One request of a run: its prompt (the request's fields where the prompt gives none), the
    run's request, where its output goes (None: latents only), whether its frames are decoded
    (``decode``: the output needs them, or the caller asked), and the caller's ``key`` for it."""

    index: int
    prompt: Prompt
    request: GenerationRequest
    output: Path | None = None
    decode: bool = False
    key: str = ""

    @property
    def mode(self) -> str:
        return self.prompt.mode(self.request.frames, self.request.sound)


def tasks_of(request: GenerationRequest, *, decode: bool = False, key: str = "") -> list[Task]:
    """The tasks of ``request``: its ``prompts`` file's lines (each with the request's fields where
    the line gives none), else its ``prompt``; outputs named per prompt with a prompts file."""
    many = request.prompts is not None
    tasks = []
    for index, prompt in enumerate(read_prompts(request.prompts, request.prompt)):
        prompt = dataclasses.replace(
            prompt,
            negative_prompt=request.negative_prompt if prompt.negative_prompt is None else prompt.negative_prompt,
            image=prompt.image or request.image,
            video=prompt.video or request.video,
            seed=request.seed if prompt.seed is None else prompt.seed,
        )
        output = output_path(request.output, index, many) if request.output else None
        tasks.append(Task(index, prompt, request, output, decode or output is not None, key))
    return tasks


def failure_line(exc: BaseException) -> str:
    """A request's failure as one line: the type and, for our errors, every problem joined."""
    problems = getattr(exc, "problems", None)
    text = "; ".join(problems) if isinstance(problems, list) and problems else str(exc)
    return f"{type(exc).__name__}: {' '.join(text.split())}"


def round_key(request: GenerationRequest) -> tuple:
    """What the tasks of one round share: their ranks' FSDP all-gathers must pair up, so every
    request group calls the same transformer modules as often (steps; the unconditional pass when
    guidance is on; the sound tower). Frames, sizes and conditioning may differ."""
    return (request.steps, request.guidance != 1.0, bool(request.sound), request.action)


class Observer:
    """What a caller learns while a round runs and what it may say back. ``on_step`` is called on
    rank 0 at every step of every request (all groups'); ``cancelled`` is asked on rank 0 at every
    step (the keys of the tasks to stop). The defaults do nothing."""

    def on_step(self, task_key: str, index: int, step: int, steps: int) -> None:
        return None

    def cancelled(self) -> frozenset[str]:
        return frozenset()


class LogObserver(Observer):
    """The launcher's: one log line per step of every request, on rank 0."""

    def __init__(self, routing) -> None:
        self.routing = routing

    def on_step(self, task_key: str, index: int, step: int, steps: int) -> None:
        label = self.routing.trace[-1] if self.routing.trace else ""
        log.info("prompt %d  step %d/%d  %s", index, step, steps, label)


def save_frames(frames: list, path: Path, fps: float) -> None:
    """Frames (PIL images) as one PNG, an animated PNG, or an mp4."""
    if path.suffix.lower() == ".mp4":
        from diffusers.utils import export_to_video

        export_to_video(frames, str(path), fps=int(round(fps)))
    elif len(frames) == 1:
        frames[0].save(path, format="PNG")
    else:
        frames[0].save(path, format="PNG", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)


@contextlib.contextmanager
def written_atomically(path: Path):
    """A temporary path beside ``path`` (same suffix), renamed onto it when the block succeeds and
    removed when it fails: a reader sees the whole file or none."""
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()


def frames_digest(frames: list) -> str:
    h = hashlib.sha256()
    for frame in frames:
        h.update(frame.convert("RGB").tobytes())
    return h.hexdigest()


class Engine:
    """Runs requests on a pipeline from ``fsdp_fp8.load_pipeline`` over its layout's request
    groups. Made on every rank (collective under ``resident="auto"``); every call of
    ``generate`` / ``run_round`` is collective over the world, with the same tasks on every rank."""

    def __init__(self, pipe, settings: RunSettings | None = None):
        self.pipe = pipe
        self.settings = settings or RunSettings()
        self.layout, self.mesh = work_of(pipe)
        self.loaded = loaded_of(pipe)
        self.device = _device_of(pipe.transformer)
        self.routing = routing_of(pipe.transformer)
        self.cache = state_of(pipe.transformer).cache  # the step cache (None: off)
        self.gate = request_gate(pipe)
        # a modular pipeline (interop.modular) is called in Cosmos3OmniPipeline's terms; a distilled
        # one runs its fixed schedule (its `distilled_sigmas`): that many steps, guidance 1.0
        self.modular = is_modular(library_class(pipe))
        self.schedule = distilled_steps(dict(pipe.config)) if self.modular else None
        self.timeout_s = self.gate.teams.timeout_s if self.gate is not None and self.gate.teams else 600.0
        self.rank = rank_and_world()[0]
        self.residency = apply_residency(
            pipe.transformer, self.settings.resident, budget_bytes=self.settings.resident_budget, device=self.device
        )
        # off: the writer decodes alone; else the request's ranks share the tiled decode
        self.decoder = request_decode(self.mesh) if self.settings.vae_tiling != "off" else None
        pipe.set_progress_bar_config(disable=True)

    def generate(self, tasks: Sequence[Task], observer: Observer | None = None) -> list[TaskResult]:
        """Every task, in rounds over the request groups (group ``g`` of ``G`` runs tasks ``g``,
        ``g + G``, ...); one result per task, in task order, the same on every rank."""
        groups = self.layout.requests
        results = []
        for start in range(0, len(tasks), groups):
            results += self.run_round(list(tasks[start : start + groups]), observer)
        return results

    def run_round(self, assignment: Sequence[Task | None], observer: Observer | None = None) -> list[TaskResult]:
        """One round: request group ``g`` runs ``assignment[g]`` (missing or None: a padding copy of
        the round's first task). Every task of the round runs the same number of steps."""
        observer = observer or Observer()
        real = [t for t in assignment if t is not None]
        if not real:
            return []
        self._refuse_off_schedule(real)
        if len({round_key(t.request) for t in real}) > 1:
            raise ArgumentError(
                "a round's tasks run the same transformer calls (FSDP gathers every block on every rank "
                "at once): as many steps, guidance on or off, sound or not; got "
                + ", ".join(sorted({str(round_key(t.request)) for t in real}))
            )
        group = self.layout.coordinates(self.rank).request
        mine = assignment[group] if group < len(assignment) else None
        keys = frozenset(t.key for t in real) if all(t.key for t in real) else None
        meeting = StepMeeting(real[0].request.steps, self.timeout_s, round_keys=keys)
        serial = self.gate.serial if self.gate is not None else 0
        row, failure, agreed = None, None, None
        try:
            row = self._run(mine or real[0], mine is not None, meeting, observer)
        except RequestMismatchError as exc:  # met at the first forward: every rank raised it alike
            agreed = str(exc)
        except RequestAbortedError:  # a peer failed before the first forward: its end note says how
            pass
        except Exception as exc:  # this rank's own: its peers learn it at the next meeting
            failure = failure_line(exc)
            self._meet_after_failure(meeting, failure, serial)
        if failure is not None or agreed is not None or meeting.stopped:
            _release_memory(self.device)
        ends = meet_at_end(RoundEnd(row.shareable() if row is not None else None, failure), self.timeout_s)
        return self._outcomes(assignment, ends, meeting, agreed, row)

    def _refuse_off_schedule(self, tasks: Sequence[Task]) -> None:
        """A distilled pipeline's tasks at another step count or guidance: diffusers' own refusal,
        raised alike on every rank (each holds the same tasks) before any of them runs."""
        if self.schedule is None:
            return
        problems = []
        for task in tasks:
            where = f"request {task.index}" + (f" ({task.key})" if task.key else "")
            problems += distilled_problems(where, task.request.steps, task.request.guidance, self.schedule)
            if task.prompt.negative_prompt is not None:
                problems.append(f"{where}: a distilled checkpoint takes no negative prompt (no guidance pass)")
        if problems:
            raise ArgumentError(problems, f"{pipeline_name(self.pipe)} runs its fixed {self.schedule}-step schedule")

    def mode_of(self, task: Task) -> str:
        """The task's mode in the report's words; a distilled pipeline's says so and its step count,
        an action job its mode, domain and chunk."""
        request = task.request
        if request.action is not None:
            return f"{request.action.replace('_', ' ')}, {request.domain}, chunk of {request.chunk_size} actions"
        return task.mode + (f", distilled, {self.schedule} steps" if self.schedule is not None else "")

    def _meet_after_failure(self, meeting: StepMeeting, failure: str, serial: int) -> None:
        """Join the meeting the peers go to next: the request's first forward (if this rank never
        reached it) or the next step's end (if steps are left); none after a stop at the first forward."""
        gate = self.gate
        if gate is None:
            return
        if gate.serial == serial:  # the pipeline was never called: the peers wait at its first forward
            gate.fail(failure)
        elif not gate.met:
            gate.meet(failure)
        elif not gate.aborted and meeting.open:
            meeting.meet(StepNote(failure=failure))

    def _run(self, task: Task, real: bool, meeting: StepMeeting, observer: Observer) -> TaskResult | None:
        """This rank's part of ``task`` (``real``: its group's own; else padding); its result on
        the writing rank of a real task, else None."""
        writes = real and self.layout.writes(self.rank)
        seconds = PhaseSeconds()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        conditioning = _conditioning(task)  # a failure: run_round meets the first forward with it
        seconds.prepare = time.perf_counter() - started
        trace_start = len(self.routing.trace)
        cache_start = len(self.cache.trace) if self.cache is not None else 0
        request = task.request
        started = time.perf_counter()
        out = self._call_pipeline(task, conditioning, self._on_step(task, writes, meeting, observer))
        seconds.denoise = time.perf_counter() - started
        if meeting.stopped or not real or (task.key and task.key in meeting.cancelled):
            return None
        latents, frames, how = out.video, None, None
        # the actions a policy or inverse-dynamics job predicts: diffusers' [T, raw width] (float32 on the CPU)
        predicted = getattr(out, "action", None)[0].float() if getattr(out, "action", None) else None
        started = time.perf_counter()
        if task.decode:
            frames, how = self._decode(latents, writes)
        seconds.decode = time.perf_counter() - started
        if not writes:
            return None
        result = TaskResult(
            index=task.index,
            prompt=task.prompt.text,
            rank=self.rank,
            key=task.key,
            mode=self.mode_of(task),
            steps=request.steps,
            steps_run=meeting.met or request.steps,
            precision_trace=describe_trace(self.routing.trace[trace_start:]),
            step_cache=self.cache.summary(cache_start) if self.cache is not None else None,
            latent_shape=list(latents.shape),
            latent_sha256=digest(latents),
            sound_sha256=digest(out.sound) if out.sound is not None else None,
            actions_shape=list(predicted.shape) if predicted is not None else None,
            actions_sha256=digest(predicted) if predicted is not None else None,
            frames_sha256=frames_digest(frames) if frames is not None else None,
            vae_decode=how,
            frames=frames,
            sound=out.sound,
        )
        started = time.perf_counter()
        if task.output is not None:
            self._write(task, frames, out.sound)
            result.output = str(task.output)
            if predicted is not None:
                _write_actions(task.output, predicted)
        seconds.write = time.perf_counter() - started
        result.seconds = seconds.rounded()
        result.peak_device_bytes = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return result

    def _call_pipeline(self, task: Task, conditioning: dict, on_step):
        """The pipeline's own call for ``task`` (a modular one through ``call_modular``), to its
        final latents (``output_type="latent"``), ``on_step`` at every step's end."""
        request = task.request
        call = functools.partial(call_modular, self.pipe) if self.modular else self.pipe
        with _scheduler_shifted(self.pipe, request.flow_shift):
            return call(
                task.prompt.text,
                negative_prompt=task.prompt.negative_prompt,
                **conditioning,
                **request.sizes(),
                fps=request.fps,
                enable_sound=request.sound,
                num_inference_steps=request.steps,
                guidance_scale=request.guidance,
                generator=torch.Generator().manual_seed(task.prompt.seed),
                callback_on_step_end=on_step,
                output_type="latent",
            )

    def _on_step(self, task: Task, writes: bool, meeting: StepMeeting, observer: Observer):
        """The pipeline's step callback: this step's meeting, and what it decides."""
        steps = task.request.steps

        def on_step(pipe, i, _t, _kwargs):
            progress = (task.key, task.index, i + 1, steps) if writes else None
            cancels = observer.cancelled() if self.rank == 0 else frozenset()
            notes = meeting.meet(StepNote(progress=progress, cancels=cancels))
            if self.rank == 0:
                for note in notes:
                    if note.progress is not None:
                        observer.on_step(*note.progress)
            if meeting.stopped or meeting.all_cancelled:
                pipe._interrupt = True  # diffusers' own: the loop skips every step left
            return {}

        return on_step

    def _decode(self, latents: torch.Tensor, writes: bool):
        """(the frames on the writer, else None; how the decode ran) as ``--vae-tiling`` says;
        collective over the request's ranks unless ``off`` (the writer decodes alone)."""
        mode = self.settings.vae_tiling
        if mode == "off":
            return (decode_video(self.pipe, latents, None) if writes else None), "untiled, on the writing rank"
        return decode_request(self.pipe, latents, self.decoder, mode)

    def _write(self, task: Task, frames, sound) -> None:
        with written_atomically(task.output) as temporary:
            if sound is None:
                save_frames(list(frames), temporary, task.request.fps)
            else:  # diffusers' own muxer (PyAV)
                from diffusers.utils.export_utils import encode_video

                rate = self.pipe.sound_tokenizer.config.sampling_rate
                fps = int(round(task.request.fps))
                encode_video(list(frames), fps, str(temporary), sound.float().cpu(), rate)

    def _outcomes(self, assignment, ends: list[RoundEnd], meeting: StepMeeting, agreed, row) -> list[TaskResult]:
        """One result per real task of the round, from what every rank knows alike (the end notes,
        the step meetings); the writer keeps its own result, frames included."""
        world = len(ends)
        failed = [(r, e.failure) for r, e in enumerate(ends) if e.failure is not None]
        results = []
        for group, task in enumerate(assignment):
            if task is None:
                continue
            ranks = [r for r in range(world) if self.layout.coordinates(r).request == group]
            own = [f"rank {r}: {message}" for r, message in failed if r in ranks]
            base = dict(index=task.index, prompt=task.prompt.text, rank=ranks[0], key=task.key, mode=self.mode_of(task))
            base |= dict(steps=task.request.steps, steps_run=meeting.met)
            if agreed is not None:
                results.append(TaskResult(**base, status=FAILED, error=agreed))
            elif own:
                results.append(TaskResult(**base, status=FAILED, error="; ".join(own)))
            elif failed:
                others = "; ".join(f"rank {r}: {message}" for r, message in failed)
                results.append(TaskResult(**base, status=FAILED, error=f"{STOPPED_WITH_ROUND}{others}"))
            elif task.key and task.key in meeting.cancelled:
                results.append(TaskResult(**base, status=CANCELLED))
            elif row is not None and self.rank == ranks[0]:
                results.append(row)
            elif ends[ranks[0]].row is not None:
                results.append(ends[ranks[0]].row)
            else:
                results.append(TaskResult(**base, status=FAILED, error="its writing rank reported no result"))
        return results


def generate(
    pipe, request: GenerationRequest, settings: RunSettings | None = None, observer: Observer | None = None
) -> list[TaskResult]:
    """Every prompt of ``request`` on ``pipe`` (from ``load_pipeline``), decoded: one
    ``Engine(pipe, settings)`` for this call (residency applied, the split decode's group made).
    Collective, like the engine; a caller running many requests keeps one ``Engine`` instead."""
    return Engine(pipe, settings).generate(tasks_of(request, decode=True), observer)


def _conditioning(task: Task) -> dict:
    """The pipeline's conditioning keywords for ``task``, its image or video read by diffusers; an
    action job's ``CosmosActionCondition`` (its first frame, its raw actions)."""
    prompt, request = task.prompt, task.request
    if request.action is not None:
        return {"action": _action_condition(request, prompt)}
    if prompt.image:
        return {"image": load_conditioning_image(prompt.image)}
    if not prompt.video:
        return {}
    kwargs = {"video": load_conditioning_video(prompt.video)}
    if request.condition_frames is not None:
        kwargs["condition_frame_indexes_vision"] = list(request.condition_frames)
    if request.condition_keep is not None:
        kwargs["condition_video_keep"] = request.condition_keep
    return kwargs


def _action_condition(request: GenerationRequest, prompt: Prompt):
    """diffusers' ``CosmosActionCondition`` of an action job (``generation.actions``; checked before
    the load): its first frame (``--image``) or clip (``--video``), its raw actions (forward dynamics)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    given = {} if request.resolution_tier is None else {"resolution_tier": request.resolution_tier}
    if request.actions is not None:
        given["raw_actions"] = torch.tensor(read_actions(request.actions), dtype=torch.float32)
    if prompt.video:
        given["video"] = load_conditioning_video(prompt.video)
    else:
        given["image"] = load_conditioning_image(prompt.image)
    return CosmosActionCondition(
        mode=request.action, chunk_size=request.chunk_size, domain_name=request.domain, **given
    )


def _write_actions(output: Path, actions: torch.Tensor) -> None:
    """The predicted actions beside the video: ``.npy`` (float32) and ``.json`` (rows of numbers)."""
    import json

    import numpy as np

    npy, as_json = actions_paths(output)
    values = actions.detach().to("cpu", torch.float32).numpy()
    with written_atomically(npy) as temporary:
        with open(temporary, "wb") as handle:
            np.save(handle, values)
    with written_atomically(as_json) as temporary:
        temporary.write_text(json.dumps(values.tolist()) + "\n")


@contextlib.contextmanager
def _scheduler_shifted(pipe, flow_shift: float | None):
    """The pipeline's scheduler with ``flow_shift`` for one call (diffusers' own idiom:
    ``from_config(scheduler.config, flow_shift=...)``), the scheduler it held put back after."""
    if flow_shift is None:
        yield
        return
    held = pipe.scheduler
    pipe.scheduler = type(held).from_config(held.config, flow_shift=flow_shift)
    try:
        yield
    finally:
        pipe.scheduler = held


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters())
    local = getattr(param, "to_local", None)
    return local().device if local is not None else param.device


def _release_memory(device: torch.device) -> None:
    """After a failed or stopped request: its tensors collected, the device's cache handed back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


__all__ = ["Engine", "LogObserver", "Observer", "Task", "generate", "round_key", "save_frames", "tasks_of"]
