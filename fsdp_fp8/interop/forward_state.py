"""One per-forward state for a diffusers pipeline's transformer, read by one subclass of ours.

``attach_pipeline_state`` swaps the transformer's class once, at load, for ``Pipelined<Class>``
(made once per class, as ``fully_shard`` makes ``FSDP<Class>``). Its methods read the
:class:`PipelineState` in ``PIPELINE_STATE``: ``cache_context`` sets the step's precision,
``__call__`` meets the request's peers and asks the CFG pair, ``_cp_shard_fn`` / ``_cp_gather_fn``
split the tokens for Ulysses, ``_run_decoder_stack`` asks the step cache.

The precision is a pure function of ``(i, n)``, so both guidance passes and every rank agree. A
step begins at a new ``(i, n)`` or a new request (the gate's serial), whatever the scheduler.

Design: docs/design.md, "One per-forward state".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn

from fsdp_fp8.collective.attached import Attachment
from fsdp_fp8.interop.cfg_parallel import CfgPair
from fsdp_fp8.interop.request_agreement import RequestGate
from fsdp_fp8.interop.step_cache import StepCache
from fsdp_fp8.runtime.precision import PrecisionRouting, set_step_precision


@dataclass
class PipelineState:
    """What a pipeline transformer's forwards read: the step routing, the optional CFG pair, the
    optional Ulysses group (an object with ``shard`` and ``gather``) and the pipeline's request
    gate (its serial tells the next request from the step running; its ranks meet at the first
    forward)."""

    routing: PrecisionRouting
    cfg: CfgPair | None = None
    ulysses: object | None = None
    gate: RequestGate | None = None
    step: tuple[int, int, int] | None = None  # (request serial, i, n) of the step running
    pass_name: str | None = None  # the pass (cache_context's name) open, for the step cache
    cache: StepCache | None = None  # the step cache (interop.step_cache), when one was asked for

    @contextlib.contextmanager
    def pass_context(self, inner, name: str, kwargs: dict):
        """``inner(name, **kwargs)`` (diffusers' own ``cache_context``) at the step's precision."""
        step, steps = kwargs.get("step_index"), kwargs.get("num_inference_steps")
        if not (isinstance(step, int) and isinstance(steps, int)):
            if self.routing.policy is not None:
                raise RuntimeError(
                    f"the pipeline entered transformer.cache_context({name!r}) without `step_index` and "
                    "`num_inference_steps`; fsdp_fp8 cannot tell which denoising step runs, so it cannot "
                    "apply the checkpoint's step policy (load with step_policy='off' to run every step W8A8)"
                )
            with inner(name, **kwargs), self._naming(name, step):
                yield
            return
        serial = self.gate.serial if self.gate is not None else 0
        new_step = (serial, step, steps) != self.step
        if new_step:
            self.step = (serial, step, steps)
        with inner(name, **kwargs), set_step_precision(self.routing, step, steps, record=new_step) as precision:
            with self._naming(name, step), self._caching(name, serial, step, steps, kwargs.get("sigma"), precision):
                yield

    @contextlib.contextmanager
    def _caching(self, name: str, serial: int, step: int, steps: int, sigma, precision: str):
        if self.cache is None:
            yield
            return
        self.cache.begin(serial, step, steps, sigma, precision)
        self.pass_name = name
        try:
            yield
        finally:
            self.cache.end()

    def run_stack(self, run, und_seq, gen_seq, rotary_emb):
        """The decoder stack of the pass running, through the step cache when there is one; the
        pass is the one the CFG pair runs (its uncond pass runs inside the cond call)."""
        if self.cache is None:
            return run(und_seq, gen_seq, rotary_emb)
        name = (self.cfg.running if self.cfg is not None else None) or self.pass_name
        return self.cache.run_stack(name, run, und_seq, gen_seq, rotary_emb)

    @contextlib.contextmanager
    def _naming(self, name: str, step):
        if self.cfg is None:
            yield
            return
        self.cfg.current = (name, step)
        try:
            yield
        finally:
            self.cfg.current = None

    def call(self, module, run, args: tuple, kwargs: dict):
        """One ``transformer(...)`` call: a request's first meets its peers; refused outside a step
        under a policy; the step cache's decision at a step's first call; else the CFG pair's
        decision, or ``run`` itself."""
        if self.gate is not None and not self.gate.met:
            self.gate.meet()
        if self.routing.policy is not None and self.routing.active == 0:
            raise RuntimeError(
                "the transformer ran outside a denoising step (transformer.cache_context with step_index): "
                "its step policy cannot be applied; call it inside fsdp_fp8.denoising_step(model, i, n)"
            )
        if self.cache is not None:  # the step's first call: every rank's vote, before FSDP gathers
            self.cache.decide(module, args, kwargs)
        if self.cfg is not None:
            return self.cfg.call(run, args, kwargs)
        return run(*args, **kwargs)


# A pipeline transformer's per-forward state, set by ``fsdp_fp8.load_pipeline``; read by the
# methods of its ``Pipelined<Class>`` (docs/design.md, "State kept on other libraries' objects").
PIPELINE_STATE: Attachment[PipelineState] = Attachment("a pipeline transformer's per-forward state")


def state_of(model: nn.Module) -> PipelineState:
    state = PIPELINE_STATE.get(model)
    if state is None:  # a copy of a loaded transformer: its state stayed with the original
        raise RuntimeError(
            f"this {type(model).__name__} has no fsdp_fp8 pipeline state (only the transformer "
            "load_pipeline returned has one; a copy does not)"
        )
    return state


_PIPELINED: dict[type, type] = {}  # a transformer class -> its one subclass of ours


def pipelined_class(cls: type) -> type:
    """``cls`` with the five methods above reading the instance's ``PipelineState``; one subclass
    per class, made once. A subclass rather than instance attributes: an attribute named
    ``cache_context`` would shadow diffusers' method and travel with copies; the class keeps the
    methods where diffusers looks them up (``self.transformer.cache_context(...)``,
    ``self._cp_shard_fn(...)``)."""
    if cls not in _PIPELINED:

        class Pipelined(cls):
            def cache_context(self, name, **kwargs):
                return state_of(self).pass_context(super().cache_context, name, kwargs)

            def __call__(self, *args, **kwargs):
                return state_of(self).call(self, super().__call__, args, kwargs)

            def _cp_shard_fn(self, und_seq, gen_seq, rotary_emb):
                ulysses = state_of(self).ulysses
                return (
                    (und_seq, gen_seq, rotary_emb) if ulysses is None else ulysses.shard(und_seq, gen_seq, rotary_emb)
                )

            def _cp_gather_fn(self, und_out, gen_out):
                ulysses = state_of(self).ulysses
                return (und_out, gen_out) if ulysses is None else ulysses.gather(und_out, gen_out)

            def _run_decoder_stack(self, und_seq, gen_seq, rotary_emb):
                return state_of(self).run_stack(super()._run_decoder_stack, und_seq, gen_seq, rotary_emb)

        Pipelined.__name__ = Pipelined.__qualname__ = f"Pipelined{cls.__name__}"
        _PIPELINED[cls] = Pipelined
    return _PIPELINED[cls]


def attach_pipeline_state(model: nn.Module, state: PipelineState) -> None:
    """Give ``model`` (a loaded pipeline transformer) its state and its one subclass of ours."""
    PIPELINE_STATE.set(model, state)
    model.__class__ = pipelined_class(type(model))
