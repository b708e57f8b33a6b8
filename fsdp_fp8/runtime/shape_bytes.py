"""Tensors as shapes whose bytes are counted while they live: the running total of live bytes
and its peak, the way a ``TorchDispatchMode`` counts the storages ops return
(:mod:`fsdp_fp8.runtime.vae_trace`), at a few microseconds an op.

A :class:`ShapeTensor` holds a shape, strides, a dtype and a storage its views share. An op that
makes a tensor adds its storage's bytes to the :class:`Run`; CPython frees the storage when its
last tensor goes, and the bytes leave the total. Code written with these in the order and with
the names of the module it mirrors frees them where that module's own tensors are freed
(:mod:`fsdp_fp8.runtime.vae_arithmetic`). Strides decide what ``view``, ``reshape`` and
``contiguous`` copy, as ATen decides.
"""

from __future__ import annotations

ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


class Run:
    """The running total of live bytes and its peak; ``calls``: what a caller keeps to replay its
    repeated calls (the VAE's: ``vae_arithmetic._call``)."""

    def __init__(self):
        self.total = self.peak = 0
        self.paused = False  # a replay's allocations: their peak was already counted
        self.calls: dict[tuple, tuple] = {}

    def input(self, shape, dtype: str) -> ShapeTensor:
        """A tensor made before the run: its bytes count once an op returns a view of it."""
        return ShapeTensor(shape, dtype, _Storage(self, numel(shape) * ITEMSIZE[dtype], counted=False))

    def add(self, nbytes: int) -> None:
        self.total += nbytes
        if not self.paused:
            self.peak = max(self.peak, self.total)


class _Storage:
    __slots__ = ("run", "nbytes", "counted")

    def __init__(self, run: Run, nbytes: int, counted: bool = True):
        self.run, self.nbytes, self.counted = run, nbytes, counted
        if counted:
            run.add(nbytes)

    def __del__(self):
        if self.counted:
            self.run.total -= self.nbytes


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def _view_strides(shape, stride, new) -> tuple[int, ...] | None:
    """The strides ``new`` has as a view of (``shape``, ``stride``), or None when it needs a copy
    (ATen's ``computeStride``)."""
    if not shape:
        return tuple(1 for _ in new)
    out, view_d = [0] * len(new), len(new) - 1
    chunk_stride, tensor_numel, view_numel = stride[-1], 1, 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and stride[d - 1] != tensor_numel * chunk_stride):
            while view_d >= 0 and (view_numel < tensor_numel or new[view_d] == 1):
                out[view_d] = view_numel * chunk_stride
                view_numel *= new[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_stride, tensor_numel, view_numel = stride[d - 1], 1, 1
    return tuple(out) if view_d == -1 else None


class ShapeTensor:
    """A tensor's shape, strides and dtype, and the storage it holds (shared by its views)."""

    __slots__ = ("shape", "stride", "dtype", "storage")

    def __init__(self, shape, dtype: str, storage: _Storage, stride=None):
        self.shape, self.dtype, self.storage = tuple(shape), dtype, storage
        self.stride = _strides(self.shape) if stride is None else tuple(stride)

    def new(self, shape, dtype: str | None = None) -> ShapeTensor:
        """A new tensor (an op's output) on this one's run."""
        dtype = dtype or self.dtype
        return ShapeTensor(shape, dtype, _Storage(self.storage.run, numel(shape) * ITEMSIZE[dtype]))

    def _view(self, shape, stride) -> ShapeTensor:
        if not self.storage.counted:
            self.storage.counted = True
            self.storage.run.add(self.storage.nbytes)
        return ShapeTensor(shape, self.dtype, self.storage, stride)

    def __getitem__(self, index) -> ShapeTensor:
        index = index if isinstance(index, tuple) else (index,)
        shape, stride = [], []
        for d, (size, st) in enumerate(zip(self.shape, self.stride)):
            i = index[d] if d < len(index) else slice(None)
            if isinstance(i, slice):
                shape.append(len(range(*i.indices(size))))
                stride.append(st)
        return self._view(shape, stride)

    def view(self, *shape) -> ShapeTensor:
        shape = self._resolved(shape)
        stride = _view_strides(self.shape, self.stride, shape)
        if stride is None or numel(shape) != numel(self.shape):
            raise RuntimeError(
                f"a view of shape {shape} of a tensor of shape {self.shape}: the mirror differs from the module"
            )
        return self._view(shape, stride)

    def reshape(self, *shape) -> ShapeTensor:
        shape = self._resolved(shape)
        stride = _view_strides(self.shape, self.stride, shape)
        return self._view(shape, stride) if stride is not None else self.new(shape)

    def _resolved(self, shape) -> tuple[int, ...]:
        if -1 in shape:
            rest = numel(d for d in shape if d != -1)
            shape = tuple(numel(self.shape) // rest if d == -1 else d for d in shape)
        return tuple(shape)

    def permute(self, *dims) -> ShapeTensor:
        return self._view([self.shape[d] for d in dims], [self.stride[d] for d in dims])

    def unsqueeze(self, dim: int) -> ShapeTensor:
        return self._view(self.shape[:dim] + (1,) + self.shape[dim:], self.stride[:dim] + (1,) + self.stride[dim:])

    def squeeze(self, dim: int) -> ShapeTensor:
        if self.shape[dim] != 1:
            return self._view(self.shape, self.stride)
        return self._view(self.shape[:dim] + self.shape[dim + 1 :], self.stride[:dim] + self.stride[dim + 1 :])

    def chunk(self, n: int, dim: int) -> list[ShapeTensor]:
        dim %= len(self.shape)
        step = -(-self.shape[dim] // n)
        return [self[(slice(None),) * dim + (slice(s, s + step),)] for s in range(0, self.shape[dim], step)]

    def expand_as(self, other: ShapeTensor) -> ShapeTensor:
        return self._view(other.shape, [s if n != 1 else 0 for n, s in zip(self.shape, self.stride)])

    def is_contiguous(self) -> bool:
        if 0 in self.shape:
            return True
        expected = 1
        for size, st in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1:
                if st != expected:
                    return False
                expected *= size
        return True

    def contiguous(self) -> ShapeTensor:
        return self if self.is_contiguous() else self.new(self.shape)

    def clone(self) -> ShapeTensor:
        return self.new(self.shape)

    def to(self, dtype: str) -> ShapeTensor:
        return self if dtype == self.dtype else self.new(self.shape, dtype)

    def float(self) -> ShapeTensor:
        return self.to("float32")

    def _op(self, other) -> ShapeTensor:
        """An elementwise op's output: the broadcast shape, this tensor's dtype."""
        if not isinstance(other, ShapeTensor):
            return self.new(self.shape)
        a, b = self.shape, other.shape
        n = max(len(a), len(b))
        a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
        return self.new(tuple(max(x, y) for x, y in zip(a, b)))

    __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = _op


def like(x: ShapeTensor) -> ShapeTensor:
    """An op that makes a tensor like ``x``: silu, clamp, exp, zeros_like."""
    return x.new(x.shape)


def cat(tensors: list[ShapeTensor], dim: int) -> ShapeTensor:
    dim %= len(tensors[0].shape)
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return tensors[0].new(shape)


def pad(x: ShapeTensor, pad) -> ShapeTensor:
    """``F.pad``: a new tensor even when every pad is 0 (``constant_pad_nd`` copies)."""
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    return x.new(shape)


def conv(x: ShapeTensor, out: int, kernel, stride=1, padding=0) -> ShapeTensor:
    """A 2-d or 3-d convolution of ``x`` (batch, channels, *space) to ``out`` channels."""
    n = len(x.shape) - 2
    k, s, p = (v if isinstance(v, tuple) else (v,) * n for v in (kernel, stride, padding))
    space = [(size + 2 * p[i] - k[i]) // s[i] + 1 for i, size in enumerate(x.shape[2:])]
    return x.new((x.shape[0], out, *space))
