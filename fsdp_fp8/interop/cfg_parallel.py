"""Classifier-free-guidance parallelism: the two passes of one step on the two ranks of a pair.

The pair is the layout's ``cfg`` mesh dim (``CfgPair.of(mesh)``). At each step cfg rank 0 runs
the conditional pass and cfg rank 1 the unconditional one, at once; one all-gather over the pair
exchanges the predictions. The latents are bit-identical to the sequential loop's.

The pipeline is not modified. Step 0 runs both passes on every rank and records the uncond pass's
step-invariant inputs; from step 1, cfg rank 1 runs that pass inside the "cond" call. A call whose
inputs are not the recorded objects raises ``RuntimeError``. ``diffusers_problems`` checks the
per-step keywords (:data:`PER_STEP`) against diffusers' signatures before the load.

Design: docs/interop.md, "CFG-parallel"; docs/design.md, "One per-forward state".
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

COND, UNCOND = "cond", "uncond"
# The pipeline's per-step latents of each modality (``Cosmos3OmniPipeline.__call__``'s keywords)
# and the transformer's keywords that carry them and their timesteps, from step to step; the
# pipeline passes the same objects to both passes of a step (its comment on the shared per-step
# timestep tensors).
MODALITIES = {"vision": "latents", "sound": "sound_latents", "action": "action_latents"}
PER_STEP = tuple(f"{m}_{part}" for m in MODALITIES for part in ("tokens", "timesteps"))
# The transformer's keywords packed once per request (``*_packed_static``): recorded at step 0.
STEP_INVARIANT = (
    "input_ids",
    "text_indexes",
    "position_ids",
    "und_len",
    "sequence_length",
    "action_domain_ids",
) + tuple(
    f"{m}_{part}"
    for m in MODALITIES
    for part in ("token_shapes", "sequence_indexes", "mse_loss_indexes", "noisy_frame_indexes")
)


def _same_object(a, b) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_object(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a == b


def _signature(result) -> tuple:
    leaves, spec = tree_flatten(result)
    if not all(t is None or isinstance(t, torch.Tensor) for t in leaves):
        kinds = sorted({type(t).__name__ for t in leaves if not isinstance(t, torch.Tensor)})
        raise RuntimeError(f"CFG-parallel exchanges tensors; the transformer returned {kinds} too")
    return spec, tuple(None if t is None else (tuple(t.shape), t.dtype) for t in leaves)


class CfgPair:
    """One rank's side of a CFG pair: what each transformer call of a step does."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank  # rank: 0 runs the cond pass, 1 the uncond
        self.current: tuple[str, int] | None = None  # (pass name, step index) of the open cache_context
        self.uncond_static: dict | None = None  # step 0's uncond call, minus PER_STEP
        self.cond_static: dict | None = None
        self.signature: tuple | None = None
        self.pending = None  # (uncond prediction, the cond call's PER_STEP values) between the two calls
        self.running: str | None = None  # the pass this rank runs inside a cond call (the step cache's key)

    @classmethod
    def of(cls, mesh) -> CfgPair:
        """This rank's side of its pair: the ``cfg`` dim of a ``ParallelMesh``."""
        dim = mesh["cfg"]
        return cls(dim.get_group(), dim.get_local_rank())

    def call(self, run, args: tuple, kwargs: dict):
        if self.current is None or args:  # outside the pipeline's loop: an ordinary call
            return run(*args, **kwargs)
        name, step = self.current
        static = {k: v for k, v in kwargs.items() if k not in PER_STEP}
        if step == 0:  # a new request: both passes here, recorded
            result = run(**kwargs)
            if name == COND:
                self.cond_static, self.uncond_static, self.pending = static, None, None
                self.signature = _signature(result)
            elif name == UNCOND:
                if _signature(result) != self.signature:
                    raise RuntimeError(
                        "CFG-parallel: the unconditional pass returned other shapes than the conditional "
                        f"one ({_signature(result)[1]} vs {self.signature[1]}); the two cannot be exchanged"
                    )
                self.uncond_static = static
            return result
        if self.uncond_static is None:  # no guidance in this request (guidance_scale 1): one pass
            return run(**kwargs)
        per_step = {k: kwargs[k] for k in PER_STEP if k in kwargs}
        if name == COND:
            self._check(static, self.cond_static, name, step)
            self.running = COND if self.rank == 0 else UNCOND
            try:
                mine = run(**kwargs) if self.rank == 0 else run(**self.uncond_static, **per_step)
            finally:
                self.running = None
            other = self._exchange(mine)
            cond, uncond = (mine, other) if self.rank == 0 else (other, mine)
            self.pending = (uncond, per_step)
            return cond
        if name == UNCOND:
            self._check(static, self.uncond_static, name, step)
            if self.pending is None or not _same_object(per_step, self.pending[1]):
                raise RuntimeError(
                    f"CFG-parallel: the uncond pass of step {step} did not follow its cond pass with the same "
                    f"latent and timesteps ({', '.join(PER_STEP)}); the prediction computed for it would be wrong"
                )
            uncond, self.pending = self.pending[0], None
            return uncond
        return run(**kwargs)

    def _check(self, static: dict, recorded: dict, name: str, step: int) -> None:
        differ = sorted(set(static) ^ set(recorded)) or sorted(
            k for k in static if not _same_object(static[k], recorded[k])
        )
        if differ:
            raise RuntimeError(
                f"CFG-parallel: the {name} pass of step {step} got other step-invariant inputs than at step 0 "
                f"({', '.join(differ)}); fsdp_fp8 relies on the pipeline packing them once per request"
            )

    def _exchange(self, mine):
        """The partner's prediction: one all-gather of both predictions' bytes over the pair."""
        leaves, spec = tree_flatten(mine)  # tensors, and None for the modalities not generated
        buf = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in leaves if t is not None])
        both = [torch.empty_like(buf) for _ in range(2)]
        dist.all_gather(both, buf, group=self.group)
        other, out, offset = both[1 - self.rank], [], 0
        for t in leaves:
            if t is None:
                out.append(None)
                continue
            n = t.numel() * t.element_size()
            out.append(other[offset : offset + n].view(t.dtype).reshape(t.shape))
            offset += n
        return tree_unflatten(out, spec)


def diffusers_problems(pipeline_cls: type, transformer_cls: type, blocks=None) -> list[str]:
    """What in ``pipeline_cls.__call__`` and ``transformer_cls.forward`` (diffusers' classes) differs
    from what ``CfgPair`` relies on: every transformer keyword is per step (:data:`PER_STEP`) or
    step-invariant (:data:`STEP_INVARIANT`), and the pipeline takes the per-step latents of each
    modality (:data:`MODALITIES`): a modular pipeline's ``blocks`` (``Cosmos3OmniBlocks``) as their
    inputs. Empty when nothing does."""
    forward = set(inspect.signature(transformer_cls.forward).parameters) - {"self", "return_dict"}
    known = set(PER_STEP) | set(STEP_INVARIANT)
    problems = [
        f"{transformer_cls.__name__}.forward takes `{name}`, which fsdp_fp8 does not know as per step "
        "or step-invariant (CFG-parallel would run the uncond pass on a stale value)"
        for name in sorted(forward - known)
    ]
    problems += [f"{transformer_cls.__name__}.forward no longer takes `{name}`" for name in sorted(known - forward)]
    if blocks is None:
        call = set(inspect.signature(pipeline_cls.__call__).parameters)
        caller = f"{pipeline_cls.__name__}.__call__ takes"
    else:
        call = {param.name for param in blocks.inputs}
        caller = f"{pipeline_cls.__name__}'s blocks ({type(blocks).__name__}) take"
    problems += [
        f"{caller} no `{latents}`: the {modality} tokens may not change per step"
        for modality, latents in MODALITIES.items()
        if latents not in call
    ]
    return problems


__all__ = ["CfgPair", "diffusers_problems"]
