"""Counter-based randomness: (seed, stream, parameter index, step, element index) -> 32 uniform bits.

All randomness in fusedopt (stochastic rounding of state, of parameters written without a
correction term, and of accumulated low-precision gradients) comes from this hash. There are
no random buffers and the global RNG is never touched, so a run is a pure function of its
seed and resuming from a checkpoint continues the same trajectory.

The hash is built from murmur3's 32-bit finaliser (``fmix32``) only: xor, logical shifts
and multiplication modulo 2**32. ``fusedopt.kernels.hashing`` writes the same function in
Triton with native uint32 arithmetic, and the two agree bit for bit (tests/test_rng.py).
Here, in plain PyTorch, values live in int64 tensors (torch has no general uint32
arithmetic) and every product is split into 16-bit halves so no intermediate overflows.

Layout of the key:
  host  = fmix32(fmix32(fmix32(seed ^ GOLDEN) ^ param_index) ^ stream)   (Python ints)
  h     = fmix32(host ^ step)                                             (step: device tensor)
  bits  = fmix32((h ^ idx_lo) + idx_hi * GOLDEN)                          (per element)
fmix32 is a bijection with full avalanche, so consecutive indices give independent-looking bits.
``step`` stays a device tensor (a skipped update leaves it unchanged without a host sync).

One draw, several roundings. The roundings of one update share the element's word from
``STREAM_SHARED`` (the kernel hashes once per element, not once per rounding: the hash was a
seventh of the fused step's time): moment ``i`` takes 12 bits (``moment_word``) and a bf16
parameter with an int8 correction the low 8 (``param_word``); the fields do not overlap, so the
roundings stay independent. A parameter that needs more bits (bf16 without a correction: 16; fp16:
up to 24) draws its own word from ``STREAM_PARAM``. Every consumer reads the TOP bits of the word
it is given, so a 12-bit field is a word whose low 20 bits are zero and stochastic rounding
resolves probabilities to 2**-12 (moments) or 2**-8 (a 24-bit master, whose grid is 2**-8 of a bf16
ulp: exactly what it can hold). A moment whose codec rounds between levels far apart next to its
increments (``MomentCodec.whole_word``: the normalised first moment, the root grid) reads 23 bits
(``top_uniform``) of a whole word instead: moment 0 the shared word itself (above a bf16 + int8
parameter's low 8 bits; beside a bf16 parameter without a correction, which then takes the low 16
and needs no word of its own, only its top 16: ``param_draw_bits``), moment 1 the shared word
re-mixed (``second_word``: a xor-shift and a multiplication, not a second hash of the element), whose
top bits are as independent of the shared word's fields as another hash's by correlation and
joint-histogram tests. Moment 1 takes a 12-bit field only where moment 0 does (``encode_moments``).

Default seeds (``DefaultSeeds``). An optimizer built without ``seed`` over several parameters uses seed
0, as before. One built without ``seed`` over ONE parameter (torchtune's optimizer-in-backward builds
one per parameter; so does any per-parameter scheme) would then draw the stream of index 0 of seed 0, as
every other such optimizer: identical rounding errors across parameters. Instead it takes a default seed
(``default_seed(slot)``) at construction: the optimizers built one after another before any of them is
used (updated, or its seed read) form a group, and each takes the lowest slot no live member of its
group holds (the k-th takes slot k unless one was dropped unused). So per-parameter optimizers built
together take distinct seeds in their construction order, and an optimizer built after a group started
training (a second run, a retry, a comparison in a test) starts a new group at slot 0: the same program
draws the same streams in a fresh process and in a long-lived one. The seed is the optimizer's ``seed``,
saved in its state dict: a resumed optimizer continues the saved stream whatever slot it took. A default
seed is ``2**62 | slot << 32 | fmix32(slot ^ DEFAULT_SALT)``: its low 32 bits (what the hash reads) lie
far from the small seeds people pass, and the slot can be read back (``default_slot``).
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
_C1 = 0x85EBCA6B
_C2 = 0xC2B2AE35

# Streams keep the draws of different roundings in one step independent.
STREAM_PARAM = 1  # a parameter that needs a word of its own (see the docstring)
STREAM_SHARED = 16  # the word shared by the moments (and a bf16 + int8 parameter)
STREAM_GRAD_ACCUM = 1 << 20  # + micro-batch index: low-precision gradient accumulation
MOMENT_DRAW_BITS = 12  # bits of the shared word per moment


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), without leaving int64 (works on ints and tensors)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def fmix32(h):
    """Murmur3 32-bit finaliser on a Python int or an int64 tensor holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


@functools.lru_cache(maxsize=65536)
def valid_seed(seed) -> bool:
    """Whether ``seed`` is a seed the optimizers take (and checkpoints may carry): an int in [0, 2**63)."""
    return isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**63


def host_key(seed: int, param_index: int, stream: int) -> int:
    """The part of the key known on the host; passed to kernels as one uint32 scalar."""
    h = fmix32((seed & MASK32) ^ GOLDEN)
    h = fmix32(h ^ (param_index & MASK32))
    return fmix32(h ^ (stream & MASK32))


def second_word(shared):
    """The second moment's whole word from the shared word (uint32 values in int64 tensors or Python ints): its
    halves mixed, then multiplied by GOLDEN, whose carries spread every bit into the top bits the codecs read."""
    return _mul32(shared ^ (shared >> 16), GOLDEN)


def uniform_bits(key: int, step: torch.Tensor, shape: torch.Size, device: torch.device, first: int = 0) -> torch.Tensor:
    """32 uniform bits per element of a tensor of ``shape`` (row-major element index), as int64.

    ``step`` is a 0-d tensor (any real dtype) holding the parameter's step count. ``first``: the
    index of the tensor's first element (a shard of a larger parameter draws its elements' bits).
    """
    return hash_bits(step_hash(key, step.to(device)), shape, device, first)


def hash_bits(h: torch.Tensor, shape: torch.Size, device: torch.device, first: int = 0) -> torch.Tensor:
    """``uniform_bits`` under the per-step hash ``h``."""
    idx = torch.arange(first, first + shape.numel(), dtype=torch.int64, device=device).reshape(shape)
    return element_bits(h, idx, beyond_32_bits=first + shape.numel() > 1 << 32)


def _signed32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


_C1_I32, _C2_I32, _GOLDEN_I32 = _signed32(_C1), _signed32(_C2), _signed32(GOLDEN)


def _fmix32_int32(h: torch.Tensor) -> torch.Tensor:
    """fmix32 on int32 tensors holding the uint32 bit patterns.

    int32 multiplication wraps modulo 2**32, which is uint32 multiplication on the same bits;
    shifts are made logical by masking the sign extension. Several times faster than the int64
    emulation; tests/test_rng.py checks both against exact integer arithmetic.
    """
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _C1_I32
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _C2_I32
    return h ^ ((h >> 16) & 0xFFFF)


def element_bits(h, idx: torch.Tensor, beyond_32_bits: bool = True) -> torch.Tensor:
    """Bits of elements ``idx`` (int64 row-major indices) under the per-step hash ``h`` (int64 result).

    ``beyond_32_bits=False`` promises every index is below 2**32 (skips the high part, which is 0).
    """
    h32 = (torch.as_tensor(h, device=idx.device).to(torch.int64) & MASK32).to(torch.int32)  # wraps to the bits
    lo = idx.to(torch.int32)  # the low 32 bits
    x = h32 ^ lo
    if beyond_32_bits:
        x = x + (idx >> 32).to(torch.int32) * _GOLDEN_I32
    return _fmix32_int32(x).to(torch.int64) & MASK32


def step_hash(key: int, step: torch.Tensor) -> torch.Tensor:
    """The per-step part of the hash (a 0-d int64 tensor on the step's device)."""
    return fmix32((step.to(torch.int64).reshape(()) & MASK32) ^ key)


def moment_word(shared: torch.Tensor, i: int) -> torch.Tensor:
    """Moment ``i``'s field of the shared word (bits ``31 - 12 i`` down), moved to the top."""
    keep = 32 - MOMENT_DRAW_BITS
    return (((shared << (MOMENT_DRAW_BITS * i)) & MASK32) >> keep) << keep


def top_uniform(words: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) on a 2**-23 grid: the top 23 bits of uint32 ``words`` (int64), exactly."""
    return (words >> 9).to(torch.int32).to(torch.float32) * 2.0**-23


def param_word(shared: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The parameter's field of the shared word (its low ``bits`` bits), moved to the top."""
    return (shared << (32 - bits)) & MASK32


def param_draw_bits(dtype: torch.dtype, master_weight_bits, first_moment_whole: bool = False) -> int:
    """Bits of the shared word the parameter's rounding takes (0: a word of its own, or none): the low 8 for a
    bf16 + int8 correction; the low 16 for bf16 without a correction beside a whole-word first moment, which
    then reads only the top 16 (the other moments' 12-bit fields leave no 16 free)."""
    if dtype == torch.bfloat16 and master_weight_bits == 24:
        return 8
    if dtype == torch.bfloat16 and master_weight_bits is None and first_moment_whole:
        return 16
    return 0


def param_shares_draw(dtype: torch.dtype, master_weight_bits, first_moment_whole: bool = False) -> bool:
    """Whether the parameter's rounding takes bits of the shared word (``param_draw_bits``)."""
    return param_draw_bits(dtype, master_weight_bits, first_moment_whole) > 0


class UpdateDraws:
    """The random words of one parameter update, drawn lazily and at most once each (``first``: the
    global index of ``param``'s first element, for the local shard of a sharded parameter)."""

    def __init__(
        self,
        seed: int,
        index: int,
        step: torch.Tensor,
        param: torch.Tensor,
        master_weight_bits,
        first: int = 0,
        first_moment_whole: bool = False,
    ):
        self._seed, self._index, self._step, self._param, self._first = seed, index, step, param, first
        self._param_bits = param_draw_bits(param.dtype, master_weight_bits, first_moment_whole)
        self._shared = None

    def _step_hash(self, stream: int) -> torch.Tensor:
        return step_hash(host_key(self._seed, self._index, stream), self._step.to(self._param.device))

    def _draw(self, stream: int) -> torch.Tensor:
        return hash_bits(self._step_hash(stream), self._param.shape, self._param.device, self._first)

    def shared(self) -> torch.Tensor:
        if self._shared is None:
            self._shared = self._draw(STREAM_SHARED)
        return self._shared

    def moment(self, i: int, whole: bool = False):
        """Moment ``i``'s bits, as the lazy callable the codecs take: its 12-bit field of the shared word, or
        (``whole``, moments 0 and 1 only) a whole word (the module docstring)."""
        if not whole:
            return lambda: moment_word(self.shared(), i)
        if i == 0 and self._param_bits == 16:  # the parameter takes the low 16 bits
            return lambda: (self.shared() >> 16) << 16
        if i == 0:
            return self.shared
        if i == 1:
            return self._second
        raise ValueError(f"only moments 0 and 1 draw a whole word, not moment {i}")

    def _second(self) -> torch.Tensor:
        return second_word(self.shared())

    def param(self):
        """The parameter's bits, as a lazy callable."""
        if self._param_bits:
            return lambda: param_word(self.shared(), self._param_bits)
        return lambda: self._draw(STREAM_PARAM)


DEFAULT_SEED_FLAG = 1 << 62  # marks a default seed (below 2**63, so every checkpoint takes it)
DEFAULT_SALT = 0x5EED5EED
_SLOT_BITS = 30


def default_seed(slot: int) -> int:
    """The default seed of ``slot`` (see the module docstring; slots wrap at 2**30)."""
    slot &= (1 << _SLOT_BITS) - 1
    return DEFAULT_SEED_FLAG | (slot << 32) | fmix32(slot ^ DEFAULT_SALT)


def default_slot(seed) -> int | None:
    """The slot whose default seed ``seed`` is, or None (not a default seed)."""
    if not valid_seed(seed) or seed >> 62 != 1:
        return None
    slot = (seed >> 32) & ((1 << _SLOT_BITS) - 1)
    return slot if seed == default_seed(slot) else None


class DefaultSeeds:
    """The groups of seedless one-parameter optimizers (module docstring); ``DEFAULT_SEEDS``: the process's.
    A new optimizer takes the lowest slot no live optimizer of the open group holds, so one that was built
    and dropped unused leaves no gap that would shift the streams of those built after it."""

    def __init__(self):
        self._lock = threading.Lock()  # optimizers may be built and used on several threads
        self._group = 0  # the group new optimizers join
        self._members: dict[int, weakref.ref] = {}  # slot -> the open group's optimizer holding it

    def assign(self, owner) -> tuple[int, int]:
        """``owner``'s default seed (a new optimizer's): the open group's lowest free slot's; and the group."""
        with self._lock:
            self._members = {slot: ref for slot, ref in self._members.items() if ref() is not None}
            slot = next(s for s in range(len(self._members) + 1) if s not in self._members)
            self._members[slot] = weakref.ref(owner)
            return default_seed(slot), self._group

    def used(self, group: int) -> None:
        """An optimizer of ``group`` is used: optimizers built from now on form a new group."""
        with self._lock:
            if group == self._group:
                self._group += 1
                self._members = {}


DEFAULT_SEEDS = DefaultSeeds()
