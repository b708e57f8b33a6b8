"""Step caching (diffusers' SeaCache) that holds across ranks: one decision per request and step,
and every rank of an FSDP shard group running the same blocks.

:class:`StepCache` uses diffusers' own indicator, gate and config (:data:`SEA_CACHE_NAMES`); only
who decides and who runs changes. At each step's first transformer call every rank votes, in one
all-gather of one int32 per rank (:class:`Voters`). A request computes when any of its ranks votes
so; a shard group runs its blocks when any request on it computes.

A step is served only from residuals of its own precision (``runtime.precision``). A request's
output is its one-rank cached output at any layout.

Usage and rules: docs/usage.md, "Step caching (`--cache seacache`)".
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format.cache_option import CacheChoice, parse_cache_option

log = logging.getLogger("fsdp_fp8")

SEA_CACHE = "diffusers.hooks.sea_cache"
# The names of diffusers' SeaCache this module uses (a test states them: tests/unit/test_diffusers_guards.py)
SEA_CACHE_NAMES = (
    "SeaCacheConfig",
    "SeaCacheContextState",
    "SeaCacheSharedState",
    "_SeaCacheForwardMetadata",
    "_build_indicator",
    "_prepare_cosmos3_raw_vision_metadata",
)


def diffusers_problems() -> list[str]:
    """What of diffusers' SeaCache this module relies on and is missing (empty: nothing)."""
    try:
        sea = importlib.import_module(SEA_CACHE)
    except ImportError as exc:
        return [f"{SEA_CACHE} cannot be imported ({exc}): diffusers 0.42.1 or later ships SeaCache"]
    problems = [f"{SEA_CACHE} has no `{name}`" for name in SEA_CACHE_NAMES if not hasattr(sea, name)]
    if hasattr(sea, "SeaCacheSharedState") and not callable(getattr(sea.SeaCacheSharedState, "resolve_gate", None)):
        problems.append(f"{SEA_CACHE}.SeaCacheSharedState has no `resolve_gate`")
    return problems


def cache_problems(transformer: str) -> list[str]:
    """Why a step cache cannot run on the diffusers transformer class named ``transformer`` (a
    pipeline's ``model_index.json``): it needs Cosmos 3's decoder stack seam and diffusers' SeaCache."""
    import diffusers

    problems = diffusers_problems()
    cls = getattr(diffusers, transformer, None)
    if not (isinstance(cls, type) and callable(getattr(cls, "_run_decoder_stack", None))):
        problems.append(
            f"the step cache runs on Cosmos 3 transformers (their `_run_decoder_stack`); `{transformer}` has none"
        )
    return problems


def sea_cache_config(choice: CacheChoice):
    """diffusers' ``SeaCacheConfig`` for ``choice``: its defaults, the threshold given."""
    from diffusers.hooks.sea_cache import SeaCacheConfig

    return SeaCacheConfig() if choice.threshold is None else SeaCacheConfig(threshold=choice.threshold)


def cache_config(cache):
    """``load_pipeline(cache=...)`` as a ``SeaCacheConfig`` or None: None / ``"off"``,
    ``"seacache[:THRESHOLD]"``, or a ``SeaCacheConfig`` itself (an ``ArgumentError`` otherwise)."""
    from diffusers.hooks.sea_cache import SeaCacheConfig

    if isinstance(cache, SeaCacheConfig):
        if cache.raw_vision_callback is not None:
            raise ArgumentError(
                "cache: a SeaCacheConfig with a raw_vision_callback is not supported (Cosmos 3's own is used)",
                "cannot use the step cache",
            )
        return cache
    choice = parse_cache_option(cache, "cache")
    return None if choice is None else sea_cache_config(choice)


def describe_config(config) -> str:
    """``seacache 0.25`` (the method and its threshold), as the report names the cache."""
    return f"seacache {config.threshold:g}"


@dataclass(frozen=True)
class Voters:
    """Who votes with this rank: the process group every rank's vote travels over (None: one
    process), this rank's index in it, each rank's request and the ranks of this rank's shard group."""

    group: object | None
    rank: int
    requests: tuple[int, ...]  # each rank's request (the layout's request coordinate)
    shard_group: tuple[int, ...]
    world: int

    @classmethod
    def of(cls, layout, group, rank: int) -> Voters:
        """From a ``ParallelLayout``: its request dim and its HSDP replica groups (the shard groups)."""
        requests = tuple(layout.coordinates(r).request for r in range(layout.world))
        replica = rank // layout.shard
        shard_group = tuple(r for r in range(layout.world) if r // layout.shard == replica)
        return cls(group, rank, requests, shard_group, layout.world)

    def decide(self, votes: list[bool]) -> tuple[bool, bool]:
        """(this rank's request computes, its shard group runs the blocks) from every rank's vote: a
        request computes when any of its ranks votes so; the blocks run when any request with a
        rank on the shard group computes (a request may span two HSDP replicas)."""
        computing = {self.requests[r] for r, vote in enumerate(votes) if vote}
        return self.requests[self.rank] in computing, any(self.requests[r] in computing for r in self.shard_group)

    def exchange(self, vote: bool, device: torch.device) -> list[bool]:
        """Every rank's vote (one all-gather of one int32 each); this rank's alone in one process."""
        if self.group is None or self.world == 1:
            return [vote]
        mine = torch.tensor([int(vote)], dtype=torch.int32, device=device)
        votes = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(votes, mine, group=self.group)
        return [bool(v) for v in torch.cat(votes).tolist()]  # one device sync


@dataclass(frozen=True)
class Decision:
    """A step's decision on this rank: whether its request computes and whether its shard group
    runs the blocks (some request on it computes)."""

    step: int
    precision: str
    computes: bool
    runs: bool


@dataclass
class Residual:
    step: int
    precision: str
    und: torch.Tensor
    gen: torch.Tensor  # the generation stream's output minus its input


@dataclass
class StepCache:
    """One pipeline transformer's step cache: diffusers' ``SeaCacheConfig``, who votes, and the
    running request's gate, residuals and decisions (reset at each new request)."""

    config: object
    voters: Voters | None = None
    serial: int | None = None
    now: tuple | None = None  # (step, steps, sigma, precision) of the open step
    decision: Decision | None = None
    computed: list[tuple[int, str]] = field(default_factory=list)  # (step, precision) the request computed
    residuals: dict[str, list[Residual]] = field(default_factory=dict)  # per pass (cond, uncond)
    trace: list[bool] = field(default_factory=list)  # per step of every request: True computed
    ran_for_peers: int = 0  # passes whose blocks ran only because a peer on the shard group computed
    gate: object = None
    shared: object = None

    def begin(self, serial: int, step: int, steps: int, sigma, precision: str) -> None:
        """A pass of step ``step`` of ``steps`` opens (``cache_context``); a new request resets."""
        if serial != self.serial:
            from diffusers.hooks.sea_cache import SeaCacheContextState, SeaCacheSharedState

            self.serial, self.decision, self.computed, self.residuals = serial, None, [], {}
            self.gate, self.shared = SeaCacheContextState(), SeaCacheSharedState()
        self.now = (step, steps, sigma, precision)

    def end(self) -> None:
        self.now = None

    def decide(self, module, args: tuple, kwargs: dict) -> None:
        """At the step's first transformer call: this rank's vote, every rank's, the step's decision."""
        if self.now is None or (self.decision is not None and self.decision.step == self.now[0]):
            return
        step, _, _, precision = self.now
        vote, gate_computes = self._vote(module, args, kwargs)
        device = next(module.parameters()).device  # the vote travels where the world group's backend does
        computes = runs = vote
        if self.voters is not None:
            computes, runs = self.voters.decide(self.voters.exchange(vote, device))
        if computes and not gate_computes:  # as diffusers does when its decision is overruled
            self.gate.accumulated_distance, self.gate.gate_should_compute = 0.0, True
        self.gate.consecutive_cached = 0 if computes else self.gate.consecutive_cached + 1
        if computes:
            self.computed = [*self.computed, (step, precision)][-(self.config.residual_order + 1) :]
        self.decision = Decision(step, precision, computes, runs)
        self.trace.append(computes)

    def _vote(self, module, args: tuple, kwargs: dict) -> tuple[bool, bool]:
        """(this rank's vote: compute?, the gate's own answer), from diffusers' indicator and gate."""
        from diffusers.hooks import sea_cache as sea

        step, steps, sigma, precision = self.now
        if sigma is None:  # the pipeline named no sigma: nothing to measure, compute
            return True, True
        metadata = sea._SeaCacheForwardMetadata(step_index=step, sigma=float(sigma), num_inference_steps=steps)
        try:  # what diffusers' hook catches, it runs full on; here the rank still votes (its peers wait)
            metadata.raw_vision = sea._prepare_cosmos3_raw_vision_metadata(module, args, kwargs)
            indicator = sea._build_indicator(self.config, metadata) if metadata.raw_vision else None
        except (TypeError, ValueError, RuntimeError) as exc:
            log.warning(
                "step cache: no indicator at step %d (%s: %s); this step computes", step, type(exc).__name__, exc
            )
            indicator = None
        gate_computes = self.shared.resolve_gate(self.gate, metadata, indicator, self.config)
        # the step policy: only residuals made at this step's precision, the last computed among them
        at_hand = bool(self.computed) and self.computed[-1][1] == precision
        return gate_computes or not at_hand, gate_computes

    def run_stack(self, name: str, run, und_seq, gen_seq, rotary_emb):
        """One pass's decoder stack (``name``: the pass, cond or uncond) as the step's decision says."""
        decision = self.decision
        if decision is None or self.now is None or decision.step != self.now[0]:
            return run(und_seq, gen_seq, rotary_emb)  # outside a decided step: an ordinary call
        cached = None if decision.computes else self._cached(name, decision, und_seq, gen_seq)
        if not decision.runs:
            return cached
        und_out, gen_out = run(und_seq, gen_seq, rotary_emb)
        if not decision.computes:
            self.ran_for_peers += 1
            return cached  # the peers needed the all-gathers; this request keeps its own decision
        kept = [*self.residuals.get(name, []), Residual(decision.step, decision.precision, und_out.detach().clone(),
                (gen_out - gen_seq).detach().clone())]  # fmt: skip
        self.residuals[name] = kept[-(self.config.residual_order + 1) :]
        return und_out, gen_out

    def _cached(self, name: str, decision: Decision, und_seq, gen_seq):
        """diffusers' cached output: the input plus the last residual of this precision, linearly
        extrapolated from the two last when ``residual_order`` is 1 (sea_cache.py's own arithmetic)."""
        history = [r for r in self.residuals.get(name, []) if r.precision == decision.precision]
        if not history or history[-1].gen.shape != gen_seq.shape or history[-1].und.shape != und_seq.shape:
            raise RuntimeError(
                f"step cache: the {name} pass of step {decision.step} has no residual of its shape and "
                f"precision ({decision.precision}) although its request decided to reuse one"
            )
        latest = history[-1]
        residual = latest.gen
        if self.config.residual_order == 1 and len(history) >= 2 and history[-2].step != latest.step:
            previous = history[-2]
            scale = (decision.step - latest.step) / (latest.step - previous.step)
            residual = latest.gen + (latest.gen - previous.gen) * scale
        return latest.und, gen_seq + residual

    def summary(self, start: int = 0) -> str:
        """The decisions from step record ``start`` on: ``seacache 0.25: computed 6, reused 4 (steps 2, 3, 5, 6)``."""
        trace = self.trace[start:]
        reused = [i for i, computed in enumerate(trace) if not computed]
        steps = f" (steps {', '.join(map(str, reused))})" if reused else ""
        return f"{describe_config(self.config)}: computed {len(trace) - len(reused)}, reused {len(reused)}{steps}"


__all__ = [
    "SEA_CACHE_NAMES",
    "StepCache",
    "Voters",
    "cache_config",
    "cache_problems",
    "diffusers_problems",
    "sea_cache_config",
]
