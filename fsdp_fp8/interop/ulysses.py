"""Ulysses attention for diffusers' ``Cosmos3OmniTransformer``: the ranks of a Ulysses group (the
layout's ``ulysses`` mesh dim) split the generation tokens of one pass, bit for bit one rank's.

:class:`Ulysses` splits and re-joins the tokens at the transformer's ``_cp_shard_fn`` /
``_cp_gather_fn`` seams. ``install_ulysses`` sets this module's processor on each attention layer,
found by type: diffusers' context-parallel path refuses causal and GQA attention. Two all-to-alls
per layer swap a rank's rows of every head for every row of its heads; the text stays whole.

Bits: a rank's slice is at least 16 rows (``ulysses_rows``); on CPU a one-head share runs as a
batch of two (:func:`full_attention`). Tensors travel as ``uint8`` bytes.

Design: docs/design.md, "Ulysses: one pass over several ranks".
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.runtime.allgather_meter import all_gather_into
from fsdp_fp8.runtime.parallel_layout import ulysses_rows


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``_rotate_half`` (``cat((-x2, x1))`` of the two halves of the last dim), the
    halves taken with ``narrow``: the same operations, and no Python indexing (fake CUDA's tier)."""
    half = x.shape[-1] // 2
    return torch.cat((-x.narrow(-1, half, x.shape[-1] - half), x.narrow(-1, 0, half)), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``Cosmos3AttnProcessor``'s rotary embedding."""
    return x * cos + _rotate_half(x) * sin


class Ulysses:
    """One rank's side of a Ulysses group: ``shard`` before the decoder stack, the attention's
    all-to-alls, ``gather`` after it. ``rank`` is this rank's coordinate on the group (its share of
    the rows and of the heads), ``size`` the group's. Holds the sizes of the pass running
    (``length``: the real generation rows; ``chunk``: each rank's rows)."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.length: int | None = None
        self.chunk: int | None = None

    @classmethod
    def of(cls, mesh) -> Ulysses:
        """This rank's side of its group: the ``ulysses`` dim of a ``ParallelMesh``."""
        dim = mesh["ulysses"]
        return cls(dim.get_group(), dim.get_local_rank(), dim.size())

    def rows(self, length: int) -> int:
        """Each rank's generation rows for a pass of ``length`` rows (``ulysses_rows``)."""
        return ulysses_rows(length, self.size)

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with zero rows appended up to every rank's chunk (``size * chunk`` rows)."""
        padded = self.size * self.chunk
        if t.shape[0] >= padded:
            return t
        return torch.cat([t, t.new_zeros((padded - t.shape[0], *t.shape[1:]))])

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        return self._padded(t).narrow(0, self.rank * self.chunk, self.chunk)

    def shard(self, und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: tuple):
        """``_cp_shard_fn``: this rank's generation rows and their rotary tables; the text whole."""
        self.length = gen_seq.shape[0]
        self.chunk = self.rows(self.length)
        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        return und_seq, self._slice(gen_seq), (cos_und, sin_und, self._slice(cos_gen), self._slice(sin_gen))

    def gather(self, und_out: torch.Tensor, gen_out: torch.Tensor):
        """``_cp_gather_fn``: every rank's generation rows, the padding dropped."""
        rows = gen_out.shape[0]
        out = gen_out.new_empty((self.size * rows, *gen_out.shape[1:]))
        self._all_gather(out, gen_out.contiguous())
        return und_out, out.narrow(0, 0, self.length)

    def to_heads(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Each (chunk, heads, dim) of this rank's rows -> (length, heads / size, dim): every real
        row, this rank's slice of the heads; all of them in one all-to-all."""
        rows, dim = xs[0].shape[0], xs[0].shape[-1]
        shares = [x.shape[1] // self.size for x in xs]
        parts = [x.reshape(rows, self.size, share, dim) for x, share in zip(xs, shares)]
        send = torch.cat(parts, dim=2).transpose(0, 1).contiguous()  # chunk j: every tensor's heads slice j
        out = torch.empty_like(send)  # contiguous: (size, rows, shares, dim), rank i's rows in chunk i
        self._all_to_all(out, send)
        both = out.reshape(self.size * rows, sum(shares), dim).narrow(0, 0, self.length)
        return list(both.split(shares, dim=1))

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: (length, heads / size, dim) -> (chunk, heads, dim) of this rank's rows."""
        _, share, dim = x.shape
        send = self._padded(x).reshape(self.size, self.chunk, share, dim).contiguous()  # chunk j: rank j's rows
        out = torch.empty_like(send)  # chunk i: this rank's rows, heads slice i
        self._all_to_all(out, send)
        return out.transpose(0, 1).reshape(self.chunk, self.size * share, dim)

    def _all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        all_gather_into(_bytes(out), _bytes(mine), group=self.group)

    def _all_to_all(self, out: torch.Tensor, send: torch.Tensor) -> None:
        dist.all_to_all_single(_bytes(out), _bytes(send), group=self.group)

    def my_heads(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``t``'s heads (dim 1)."""
        share = t.shape[1] // self.size
        return t.narrow(1, self.rank * share, share)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes (gloo takes no bfloat16 or float8; NCCL takes the same bytes)."""
    return t.view(torch.uint8)


class UlyssesCosmos3AttnProcessor:
    """``Cosmos3AttnProcessor``'s computation with the generation pathway split over a Ulysses
    group (module docstring); the text pathway exactly as diffusers' processor runs it."""

    def __init__(self, ulysses: Ulysses, backend=None):
        self.ulysses = ulysses
        self._attention_backend = backend

    def __call__(self, attn, und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: tuple):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        sp = self.ulysses
        heads, kv_heads, dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.to_q(und_seq).view(-1, heads, dim)
        k_und = attn.to_k(und_seq).view(-1, kv_heads, dim)
        v_und = attn.to_v(und_seq).view(-1, kv_heads, dim)
        q_gen = attn.add_q_proj(gen_seq).view(-1, heads, dim)
        k_gen = attn.add_k_proj(gen_seq).view(-1, kv_heads, dim)
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv_heads, dim)

        q_und, k_und = attn.norm_q(q_und), attn.norm_k(k_und)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        q_gen, k_gen = attn.norm_added_q(q_gen), attn.norm_added_k(k_gen)

        cos_und, sin_und, cos_gen, sin_gen = (t.unsqueeze(1) for t in rotary_emb)
        q_und, k_und = _rope(q_und, cos_und, sin_und), _rope(k_und, cos_und, sin_und)
        k_und_for_gen = _rope(k_und_for_gen, cos_und, sin_und)
        q_gen, k_gen = _rope(q_gen, cos_gen, sin_gen), _rope(k_gen, cos_gen, sin_gen)

        causal_out = dispatch_attention_fn(
            q_und.unsqueeze(0),
            k_und.unsqueeze(0),
            v_und.unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
            backend=self._attention_backend,
        )
        causal_out = causal_out.squeeze(0).flatten(-2, -1)

        # Fewer key/value heads than ranks: each rank's query heads share one key/value head,
        # which goes to every rank that needs it (repeated as GQA would; the same values).
        repeat = max(sp.size // kv_heads, 1)
        if repeat > 1:
            k_und_for_gen, v_und, k_gen, v_gen = (
                t.repeat_interleave(repeat, dim=1) for t in (k_und_for_gen, v_und, k_gen, v_gen)
            )
        q_gen, k_gen, v_gen = sp.to_heads(q_gen, k_gen, v_gen)
        all_k = torch.cat([sp.my_heads(k_und_for_gen), k_gen], dim=0)
        all_v = torch.cat([sp.my_heads(v_und), v_gen], dim=0)
        full_out = full_attention(q_gen, all_k, all_v, self._attention_backend)
        full_out = sp.to_rows(full_out).flatten(-2, -1)
        return attn.to_out(causal_out), attn.to_add_out(full_out)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend=None) -> torch.Tensor:
    """The generation pathway's attention over a rank's heads, (rows, heads, dim) each, as
    ``Cosmos3AttnProcessor`` calls it (``dispatch_attention_fn``, not causal, grouped-query).

    On CPU, torch's SDPA kernel splits its work into (batch, head, query block) items; with
    several, each item's GEMMs run on one thread, but a call of a single item on several threads
    runs its GEMMs multi-threaded, which rounds differently. One rank's call holds every head, so
    several items; a rank holding one head would make one item of a short pass. It then sends that
    head twice, as a batch of two, and keeps the first: the GEMMs of one rank's call, twice one
    head's work (module docstring)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    q, k, v = (t.unsqueeze(0) for t in (q, k, v))
    if q.device.type == "cpu" and q.shape[2] == 1 and torch.get_num_threads() > 1:
        q, k, v = (t.expand(2, *t.shape[1:]) for t in (q, k, v))
    out = dispatch_attention_fn(q, k, v, is_causal=False, enable_gqa=True, backend=backend)
    return out.select(0, 0)


def _cosmos3():
    from diffusers.models.transformers import transformer_cosmos3

    return transformer_cosmos3


# What this module relies on in diffusers' Cosmos 3 transformer (diffusers_problems states it):
# the processor's call, whose computation UlyssesCosmos3AttnProcessor repeats, and the seams.
PROCESSOR_CALL = ("self", "attn", "und_seq", "gen_seq", "rotary_emb")
SEAMS = ("_cp_shard_fn", "_cp_gather_fn")


def diffusers_problems(module=None) -> list[str]:
    """What changed in diffusers' Cosmos 3 transformer (``module``, default the installed one) that
    this module's processor and seams rely on: empty when nothing did."""
    module = module or _cosmos3()
    problems = []
    attention, processor = module.Cosmos3PackedMoTAttention, module.Cosmos3AttnProcessor
    call = tuple(inspect.signature(processor.__call__).parameters)
    if call != PROCESSOR_CALL:
        problems.append(f"{processor.__name__}.__call__ takes {call}, not {PROCESSOR_CALL}")
    if attention._default_processor_cls is not processor:
        problems.append(
            f"{attention.__name__}'s default processor is {attention._default_processor_cls.__name__}, "
            f"not {processor.__name__}"
        )
    transformer = module.Cosmos3OmniTransformer
    problems += [f"{transformer.__name__} has no seam `{seam}`" for seam in SEAMS if not hasattr(transformer, seam)]
    return problems


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The ``Cosmos3PackedMoTAttention`` modules of ``model`` (by type)."""
    return [m for m in model.modules() if isinstance(m, _cosmos3().Cosmos3PackedMoTAttention)]


def install_ulysses(model: nn.Module, ulysses: Ulysses) -> int:
    """Give every attention layer of ``model`` (a Cosmos 3 transformer) the Ulysses processor of
    ``ulysses``; returns how many. The seams (``_cp_shard_fn`` / ``_cp_gather_fn``) are the
    pipeline state's (``interop.forward_state``). Refused when diffusers' transformer changed
    (``diffusers_problems``), or a layer's processor is not diffusers' own."""
    module = _cosmos3()
    modules = attention_modules(model)
    problems = diffusers_problems(module)
    if not modules:
        problems.append(
            f"{type(model).__name__} has no Cosmos3PackedMoTAttention: Ulysses splits Cosmos 3 transformers only"
        )
    problems += sorted(
        {
            f"an attention layer has processor {type(m.processor).__name__}, not diffusers' Cosmos3AttnProcessor "
            "(whose computation the Ulysses processor repeats)"
            for m in modules
            if type(m.processor) is not module.Cosmos3AttnProcessor
        }
    )
    if problems:
        raise ArgumentError(problems, "Ulysses attention")
    for m in modules:
        m.set_processor(UlyssesCosmos3AttnProcessor(ulysses, getattr(m.processor, "_attention_backend", None)))
    return len(modules)
