"""Placement-independent random numbers: every element's value is a hash of its global index.

Why: a random DTensor must hold the same global values whatever its mesh and placements,
and each rank must compute only its own block. A sequential generator (torch's) cannot do
that without drawing the whole global tensor everywhere. A counter-based generator can:

    word(i) = mix(key(seed), counter),   counter = offset + words_per_element * i + j

where ``i`` is the element's linear index in the GLOBAL tensor (row-major over the global
shape, whatever block holds it), ``j`` picks one of the element's words (normal float64 uses
two), ``offset`` is the position of this op in the process's random stream and ``mix`` is the
SplitMix64 construction: ``counter * 0x9E3779B97F4A7C15 + key`` followed by its 64-bit
finalizer (xor-shift-multiply twice, xor-shift). Distinct counters give distinct words (every
step is a bijection of the 64-bit integers); the output sequence is SplitMix64's, which passes
BigCrush, and the streams of different seeds are far-apart segments of its 2**64-long cycle
(the key is a hash of the seed). Not cryptographic. Words become values as follows:

* uniform: the top ``m`` bits times ``2**-m``, ``m`` the dtype's significand bits (53 for
  float64, 24 float32, 11 float16, 8 bfloat16), so every value is exact in the dtype and
  lies in [0, 1), never 1.0.
* normal: Box-Muller, ``sqrt(-2 ln u1) * cos(2 pi u2)``. float64 takes u1 and u2 (53 bits
  each, u1 in (0, 1]) from two words; other dtypes take a 32-bit u1 and a 24-bit u2 from one
  word, compute in float32 and cast (|value| <= 6.8).
* bernoulli: ``u < p`` with u the 53-bit uniform.

Cost: the index arithmetic (one broadcast add over the block), 11 int64 ops for the hash, a
few more to turn bits into floats (plus log, sqrt and cos for normal): a few dozen elementwise
torch ops per element, O(local numel) time and memory, no communication. On CPU the block is
processed in cache-sized chunks. Every op is elementwise and the integer and scaling steps are
exact (int arithmetic wraps modulo 2**64, floats are scaled by powers of two), so a value does
not depend on which block, or which position in a block, computes it. (Ranks must run the
same torch build on the same kind of CPU/GPU: log and cos may round differently elsewhere.)

Stream state: each process has one ``RNGState`` (seed, offset). Its seed follows
``torch.initial_seed()``: it is re-read before every draw, and when it changed (the user called
``torch.manual_seed`` with a new seed) the offset restarts at 0. ``manual_seed`` here sets the
torch seed and restarts the stream even when the seed is unchanged; ``torch.manual_seed`` with
the seed already in use is not noticed. Every random op consumes the GLOBAL element count times
its words per element (rounded up to a multiple of 4) from the offset, so successive ops
differ and every rank advances identically (SPMD: every rank runs the same ops), whatever its
block. Ranks must therefore be seeded identically; torch seeds every process differently by
default.

The values are NOT torch's generator's values: ``shardwise.randn`` equals itself across
layouts, not ``torch.randn`` after the same seed.

Example:
    >>> whole = uniform((4, 6), (0, 0), (4, 6), seed=7, offset=0)
    >>> torch.equal(uniform((4, 6), (1, 2), (2, 3), seed=7, offset=0), whole[1:3, 2:5])
    True
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from shardwise.core.spec import DTensorSpec

__all__ = [
    "RNGState",
    "meta_fills_advance",
    "bernoulli",
    "draw",
    "get_rng_state",
    "layout_independent",
    "manual_seed",
    "mix64",
    "next_offset",
    "normal",
    "random_bits",
    "random_block",
    "set_rng_state",
    "uniform",
    "words_per_element",
]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: counter * gamma is a bijection
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_KEY_SALT = 0x5EED5EED5EED5EED  # so that seed 0 does not map to key 0
_OFFSET_ALIGN = 4
_CPU_CHUNK = 1 << 16  # elements per pass on CPU: 512 KiB of int64 stays in cache
_TWO_PI = 2.0 * math.pi
# Significand bits (with the implicit one) of the float dtypes uniform draws exactly.
_SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
KINDS = ("uniform", "normal", "bernoulli")


# ---------------------------------------------------------------------- 64-bit helpers
def _signed(value: int) -> int:
    """``value`` modulo 2**64 as the int64 with the same bits (torch scalars must fit int64)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def mix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int: the reference the tensor code must match."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _key(seed: int) -> int:
    """The 64-bit hash key of a seed; hashing spreads nearby seeds over the whole key space."""
    return mix64(int(seed) + _KEY_SALT)


def _xorshift_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """``x ^= x >>> shift`` in place; torch's ``>>`` on int64 is arithmetic, so mask the sign."""
    torch.bitwise_right_shift(x, shift, out=scratch)
    scratch.bitwise_and_((1 << (64 - shift)) - 1)
    x.bitwise_xor_(scratch)


def _finalize_(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on an int64 tensor, in place (multiplication wraps mod 2**64)."""
    scratch = torch.empty_like(x)
    _xorshift_(x, 30, scratch)
    x.mul_(_signed(_MIX1))
    _xorshift_(x, 27, scratch)
    x.mul_(_signed(_MIX2))
    _xorshift_(x, 31, scratch)
    return x


def _top_bits_(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``bits`` most significant bits of each word as a non-negative int64, in place."""
    return words.bitwise_right_shift_(64 - bits).bitwise_and_((1 << bits) - 1)


# ---------------------------------------------------------------------- blocks
def _check_block(global_shape: Sequence[int], block_offset: Sequence[int], block_shape: Sequence[int]) -> None:
    """Reject blocks that do not lie inside the global tensor (they would alias other elements)."""
    if not len(global_shape) == len(block_offset) == len(block_shape):
        raise ValueError(f"block offset {tuple(block_offset)} and shape {tuple(block_shape)} "
                         f"do not match the rank of global shape {tuple(global_shape)}")
    for size, start, length in zip(global_shape, block_offset, block_shape):
        if length < 0 or start < 0 or (length > 0 and start + length > size):
            raise ValueError(f"block at {tuple(block_offset)} of shape {tuple(block_shape)} "
                             f"is outside global shape {tuple(global_shape)}")


def _coalesce(
    global_shape: Sequence[int], block_offset: Sequence[int], block_shape: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """Merge every dim the block spans whole into the dim before it (same linear indices).

    A Shard(0) block of a matrix becomes one run of a 1-D tensor, which is cheaper to index.
    """
    sizes, starts, lengths = [1], [0], [1]  # a leading unit dim absorbs whole leading dims
    for size, start, length in zip(global_shape, block_offset, block_shape):
        if length == size and start == 0:
            sizes[-1], starts[-1], lengths[-1] = sizes[-1] * size, starts[-1] * size, lengths[-1] * size
        else:
            sizes.append(size)
            starts.append(start)
            lengths.append(length)
    if len(sizes) > 1 and sizes[0] == 1:  # no whole leading dims: the unit dim is not needed
        del sizes[0], starts[0], lengths[0]
    return sizes, starts, lengths


def random_bits(
    global_shape: Sequence[int],
    block_offset: Sequence[int],
    block_shape: Sequence[int],
    *,
    seed: int,
    offset: int,
    words: int = 1,
    word: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """64 random bits (int64) per element of a block: ``mix(key(seed), offset + words*i + word)``.

    ``i`` is the element's row-major index in the global tensor. ``counter * gamma`` is built
    as a broadcast sum of one small vector per (coalesced) dim: about one op over the block.
    """
    _check_block(global_shape, block_offset, block_shape)
    sizes, starts, lengths = _coalesce(global_shape, block_offset, block_shape)
    step = _GAMMA * words  # (offset + word + words * i) * gamma = base + i * step, modulo 2**64
    x = torch.tensor(_signed((offset + word) * _GAMMA + _key(seed)), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(sizes))):
        along = torch.arange(starts[dim], starts[dim] + lengths[dim], dtype=torch.int64, device=device)
        along.mul_(_signed(step * stride))
        x = along.add_(x) if x.ndim == 0 else x + along.view(-1, *(1,) * x.ndim)
        stride *= sizes[dim]
    return _finalize_(x.reshape(tuple(block_shape)))


def _chunks(
    block_offset: Sequence[int], block_shape: Sequence[int], limit: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Sub-blocks of at most ``limit`` elements (where possible) in row-major order.

    Each covers whole trailing dims or a single row, so concatenating them flat gives the
    block flat: ``_generate`` writes each into a contiguous slice of the output.
    """
    if not block_shape:
        yield (), ()
        return
    rest = math.prod(block_shape[1:])
    if rest <= limit or len(block_shape) == 1:
        rows = max(1, limit // max(rest, 1))
        for row in range(0, block_shape[0], rows):
            yield (block_offset[0] + row, *block_offset[1:]), (min(rows, block_shape[0] - row), *block_shape[1:])
        return
    for row in range(block_shape[0]):
        for sub_offset, sub_shape in _chunks(block_offset[1:], block_shape[1:], limit):
            yield (block_offset[0] + row, *sub_offset), (1, *sub_shape)


def _generate(
    convert: Callable[..., torch.Tensor],
    global_shape: Sequence[int],
    block_offset: Sequence[int],
    block_shape: Sequence[int],
    *,
    seed: int,
    offset: int,
    words: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
    out: torch.Tensor | None = None,
    scale: float | None = None,
    shift: float | None = None,
) -> torch.Tensor:
    """Apply ``convert(*words)`` to the random words of the block, chunk by chunk.

    On CPU, chunks of ``_CPU_CHUNK`` elements keep the int64 temporaries in cache (about twice
    as fast as whole-block passes on 1M elements); on accelerators one pass does it all.
    ``scale`` then ``shift``, if given, are applied in ``dtype`` after the values are rounded to
    it (the same arithmetic as ``block * scale + shift`` on the whole block). With ``out`` (a
    contiguous tensor of the block's shape and ``dtype``) the values are written straight into
    it: an initialization then needs no temporary the size of the block.
    """
    _check_block(global_shape, block_offset, block_shape)
    if out is None or not out.is_contiguous() or out.dtype != dtype or tuple(out.shape) != tuple(block_shape):
        target = torch.empty(tuple(block_shape), dtype=dtype, device=device if out is None else out.device)
    else:
        target = out
    flat, done = target.view(-1), 0
    limit = _CPU_CHUNK if target.device.type == "cpu" else max(target.numel(), 1)
    for sub_offset, sub_shape in _chunks(block_offset, block_shape, limit):
        bits = [
            random_bits(global_shape, sub_offset, sub_shape, seed=seed, offset=offset, words=words, word=j,
                        device=target.device)
            for j in range(words)
        ]
        count = math.prod(sub_shape)
        values = convert(*bits).reshape(-1).to(dtype)
        if scale is not None:
            values.mul_(scale)
        if shift is not None:
            values.add_(shift)
        flat[done : done + count] = values
        done += count
    if out is not None and target is not out:
        out.copy_(target)
        return out
    return target


def _significand_bits(dtype: torch.dtype) -> int:
    bits = _SIGNIFICAND_BITS.get(dtype)
    if bits is None:
        raise TypeError(f"random floats need a float dtype (float64/32/16, bfloat16), got {dtype}")
    return bits


def uniform(
    global_shape: Sequence[int],
    block_offset: Sequence[int],
    block_shape: Sequence[int],
    *,
    seed: int,
    offset: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    **into: Any,
) -> torch.Tensor:
    """Uniform [0, 1) values of one block of a global random tensor (see the module docstring).

    ``into``: ``out``, ``scale``, ``shift`` as for ``draw``.

    Example:
        >>> uniform((10,), (4,), (3,), seed=0, offset=0)  # elements 4, 5, 6 of the whole
    """
    bits = _significand_bits(dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32

    def convert(words: torch.Tensor) -> torch.Tensor:
        return _top_bits_(words, bits).to(work).mul_(2.0 ** -bits)

    args = (global_shape, block_offset, block_shape)
    return _generate(convert, *args, seed=seed, offset=offset, words=1, dtype=dtype, device=device, **into)


def _box_muller_f64(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Normal float64 values from two words each: 53-bit u1 in (0, 1] and 53-bit u2."""
    radius = _top_bits_(first, 53).add_(1).to(torch.float64).mul_(2.0 ** -53)
    angle = _top_bits_(second, 53).to(torch.float64).mul_(_TWO_PI * 2.0 ** -53)
    return radius.log_().mul_(-2.0).sqrt_().mul_(angle.cos_())


def _box_muller_f32(word: torch.Tensor) -> torch.Tensor:
    """Normal float32 values from one word each: u1 from the top 32 bits, u2 from the next 24."""
    angle = (word >> 8).bitwise_and_((1 << 24) - 1).to(torch.float32).mul_(_TWO_PI * 2.0 ** -24)
    radius = _top_bits_(word, 32).to(torch.float32).add_(0.5).mul_(2.0 ** -32)  # (0, 1]
    return radius.log_().mul_(-2.0).sqrt_().mul_(angle.cos_())


def normal(
    global_shape: Sequence[int],
    block_offset: Sequence[int],
    block_shape: Sequence[int],
    *,
    seed: int,
    offset: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    **into: Any,
) -> torch.Tensor:
    """Standard normal values of one block (Box-Muller; two words per element for float64)."""
    _significand_bits(dtype)
    wide = dtype == torch.float64
    convert, words = (_box_muller_f64, 2) if wide else (_box_muller_f32, 1)
    args = (global_shape, block_offset, block_shape)
    return _generate(convert, *args, seed=seed, offset=offset, words=words, dtype=dtype, device=device, **into)


def bernoulli(
    p: float | torch.Tensor,
    global_shape: Sequence[int],
    block_offset: Sequence[int],
    block_shape: Sequence[int],
    *,
    seed: int,
    offset: int,
    dtype: torch.dtype = torch.bool,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """1 with probability ``p`` (a float, or a tensor broadcastable to the block), else 0.

    An element is 1 when its 53-bit uniform ``u`` is below ``p``, so ``p`` of 0 and 1 are exact.
    """
    if isinstance(p, torch.Tensor):
        u = uniform(global_shape, block_offset, block_shape, seed=seed, offset=offset, dtype=torch.float64, device=device)
        return (u < p.to(device=u.device, dtype=torch.float64)).to(dtype)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bernoulli probability must be in [0, 1], got {p}")
    threshold = math.ceil(p * 2.0 ** 53)  # k < threshold  <=>  k * 2**-53 < p, exactly

    def convert(words: torch.Tensor) -> torch.Tensor:
        return _top_bits_(words, 53) < threshold

    args = (global_shape, block_offset, block_shape)
    return _generate(convert, *args, seed=seed, offset=offset, words=1, dtype=dtype, device=device)


def words_per_element(kind: str, dtype: torch.dtype) -> int:
    """How many counters one element of ``kind`` uses: 2 for float64 normal, else 1."""
    if kind not in KINDS:
        raise ValueError(f"unknown random kind {kind!r}; expected one of {KINDS}")
    return 2 if kind == "normal" and dtype == torch.float64 else 1


# ---------------------------------------------------------------------- stream state
@dataclass
class RNGState:
    """The process's random stream: a seed and the next unused counter.

    ``torch_seed`` is the ``torch.initial_seed()`` seen last; a different value on the next
    draw means the user reseeded torch, and the stream restarts from that seed.
    """

    seed: int | None = None
    offset: int = 0
    torch_seed: int | None = None

    def sync(self) -> None:
        """Follow ``torch.manual_seed``: adopt torch's seed when it changed since last seen."""
        current = torch.initial_seed()
        if current != self.torch_seed:
            self.seed, self.offset, self.torch_seed = current, 0, current

    def reset(self, seed: int) -> None:
        """Restart the stream at ``seed`` (offset 0), remembering torch's current seed."""
        self.seed, self.offset, self.torch_seed = int(seed) & _MASK64, 0, torch.initial_seed()

    def take(self, count: int) -> tuple[int, int]:
        """Reserve ``count`` counters (rounded up to a multiple of 4): returns (seed, first)."""
        if count < 0:
            raise ValueError(f"cannot reserve {count} random counters")
        self.sync()
        first = self.offset
        self.offset += -(-count // _OFFSET_ALIGN) * _OFFSET_ALIGN
        return self.seed, first


_STATE = RNGState()


def manual_seed(seed: int) -> None:
    """Seed torch and restart shardwise's stream at ``seed``, even if that seed is in use.

    Call it with the same seed on every rank.
    """
    torch.manual_seed(seed)
    _STATE.reset(torch.initial_seed())


def next_offset(numel: int) -> int:
    """Reserve ``numel`` counters of the process's stream and return the first one.

    Every rank must reserve the same counts in the same order (pass GLOBAL element counts).
    """
    return _STATE.take(numel)[1]


def get_rng_state() -> tuple[int, int]:
    """(seed, offset) of the process's stream, e.g. to replay a dropout mask in a recompute."""
    _STATE.sync()
    return _STATE.seed, _STATE.offset


def set_rng_state(state: tuple[int, int]) -> None:
    """Restore a state from ``get_rng_state``; the seed stays until torch is reseeded."""
    seed, offset = state
    _STATE.reset(seed)
    _STATE.offset = offset


# ---------------------------------------------------------------------- draws
def draw(
    kind: str,
    global_shape: Sequence[int],
    block_offset: Sequence[int],
    block_shape: Sequence[int],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    p: float | torch.Tensor = 0.5,
    out: torch.Tensor | None = None,
    scale: float | None = None,
    shift: float | None = None,
) -> torch.Tensor:
    """One block of a fresh global random tensor from the process's stream.

    Consumes the counters of the WHOLE tensor, so call it on every rank, also on ranks that
    hold an empty block. ``kind``: "uniform", "normal" or "bernoulli" (probability ``p``;
    dtype defaults to bool there and to the default float dtype otherwise). For uniform and
    normal, ``scale`` and ``shift`` give ``values * scale + shift`` (in ``dtype``) and ``out``
    receives them in place (the block's tensor, e.g. a parameter being initialized).
    """
    dtype = dtype or (torch.bool if kind == "bernoulli" else torch.get_default_dtype())
    numel = math.prod(global_shape)
    seed, offset = _STATE.take(numel * words_per_element(kind, dtype))
    options = {"seed": seed, "offset": offset, "dtype": dtype, "device": device}
    if kind == "bernoulli":
        return bernoulli(p, global_shape, block_offset, block_shape, **options)
    generate = uniform if kind == "uniform" else normal
    return generate(global_shape, block_offset, block_shape, **options, out=out, scale=scale, shift=shift)


def random_block(
    kind: str, spec: DTensorSpec, *, p: float | torch.Tensor = 0.5,
    out: torch.Tensor | None = None, scale: float | None = None, shift: float | None = None,
) -> torch.Tensor:
    """This rank's local tensor of a random DTensor with ``spec`` (a ``DTensorSpec``).

    Shard axes cut the block; on Partial axes the value sits on axis-rank 0 for sum (zeros
    elsewhere) and everywhere for avg/max/min, so the reduction gives the random value back.
    Bernoulli blocks take the spec's dtype too. ``out``, ``scale``, ``shift``: as for ``draw``
    (``out`` is this rank's block of a DTensor being filled in place).
    """
    local_shape, local_offset = spec.local_shape_and_offset()
    mesh = spec.mesh
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else mesh.device_type
    extra = {"out": out, "scale": scale, "shift": shift} if kind != "bernoulli" else {}
    local = draw(kind, tuple(spec.shape), local_offset, local_shape, dtype=spec.dtype, device=device, p=p, **extra)
    coordinate = mesh.get_coordinate()
    if coordinate is not None:
        for axis, placement in enumerate(spec.placements):
            if placement.is_partial():
                local = placement.partition_value(local, coordinate[axis])
    if out is not None and local is not out:
        out.copy_(local)
        return out
    return local


# ---------------------------------------------------------------------- plain tensors
class _PlainFills(TorchDispatchMode):
    """Routes ``uniform_`` / ``normal_`` on plain tensors to the stream; everything else passes.

    A plain tensor is taken as a whole global tensor (its block is all of it), so it receives
    exactly the values a DTensor of the same global shape receives, whatever its layout. Meta
    tensors have no values: they are left alone and consume no counters, as torch's generator
    does not advance for meta tensors either.
    """

    @staticmethod
    def active() -> bool:
        """Whether a ``layout_independent`` block is open (its mode is on the dispatch stack)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        return any(isinstance(mode, _PlainFills) for mode in _get_current_dispatch_mode_stack())

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        fill = _PLAIN_FILLS.get(func)
        target = args[0] if args else None
        if fill is None or type(target) not in (torch.Tensor, torch.nn.Parameter):
            return func(*args, **kwargs)
        if target.is_meta:
            if _META_FILLS_ADVANCE[0]:
                kind = "uniform" if func is torch.ops.aten.uniform_.default else "normal"
                _STATE.take(target.numel() * words_per_element(kind, target.dtype))
            return target
        return fill(target, *args[1:], **kwargs)


_META_FILLS_ADVANCE = [False]


@contextmanager
def meta_fills_advance() -> Iterator[None]:
    """Inside, ``layout_independent`` fills of plain meta tensors consume their counters (nothing drawn).

    A pipeline stage initializes its own modules while the modules of the other stages stay on
    the meta device: with their fills advancing the stream as real ones would, every stage's
    parameters get the values of the whole model initialized on one device. ``uniform_`` and
    ``normal_`` are counted where they are dispatched; ``nn.init.trunc_normal_`` returns early
    for meta tensors (before any op), so inside it is wrapped to count its one ``uniform_``.
    """
    _META_FILLS_ADVANCE[0], before = True, _META_FILLS_ADVANCE[0]
    original = torch.nn.init.trunc_normal_

    def trunc_normal_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if tensor.is_meta and type(tensor) in (torch.Tensor, torch.nn.Parameter) and _PlainFills.active():
            _STATE.take(tensor.numel() * words_per_element("uniform", tensor.dtype))
            return tensor
        return original(tensor, *args, **kwargs)

    torch.nn.init.trunc_normal_ = trunc_normal_
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_ = original
        _META_FILLS_ADVANCE[0] = before


def _fill_uniform_(t: torch.Tensor, low: float = 0.0, high: float = 1.0, *, generator: Any = None, **kw: Any) -> torch.Tensor:
    low, high = kw.get("from", low), kw.get("to", high)
    shape = tuple(t.shape)  # the same arithmetic as a DTensor's uniform_, written in place
    return draw("uniform", shape, (0,) * len(shape), shape, dtype=t.dtype, device=t.device,
                out=t, scale=high - low, shift=low)


def _fill_normal_(t: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    shape = tuple(t.shape)  # the same arithmetic as a DTensor's normal_, written in place
    return draw("normal", shape, (0,) * len(shape), shape, dtype=t.dtype, device=t.device,
                out=t, scale=std, shift=mean)


_PLAIN_FILLS: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops.aten.uniform_.default: _fill_uniform_,
    torch.ops.aten.normal_.default: _fill_normal_,
}


@contextmanager
def layout_independent() -> Iterator[None]:
    """Inside, plain tensors' random fills draw from shardwise's stream, as DTensors' do.

    ``uniform_`` and ``normal_`` (what ``nn.init`` uses: ``normal_``, ``uniform_``,
    ``trunc_normal_``, the Kaiming and Xavier inits) on a plain tensor give the values a
    DTensor of the same global shape gets from the same stream position. So a model
    initialized whole on one device and the same model initialized after sharding (built on
    the meta device, parallelized, ``to_empty``) hold equal parameters given the same seed
    and the same order of fills. Meta tensors are skipped and consume no counters.

    Example:
        >>> manual_seed(0)
        >>> with layout_independent():
        ...     model.init_weights()          # one device, or every rank of a sharded model
    """
    with _PlainFills():
        yield
