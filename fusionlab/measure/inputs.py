"""Independently seeded input sets for one cell, their float64 references, and their rotation.

Timing rotates over several sets: consecutive calls never see the same tensors, and a rotation
larger than the device's last cache level makes the timing cache-cold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fusionlab.measure import rules
from fusionlab.measure.timing import draw
from fusionlab.op import Inputs, OpSpec, Shape

WARM_SETS = 2
MAX_COLD_SETS = 4096
MAX_ROTATION_BYTES = 2**30  # beyond this a cold rotation is capped, and the record says so
COLD_FACTOR = 2  # the rotation must be this many times the cache


def tensors_in(inputs: Inputs) -> list[torch.Tensor]:
    return [item for item in inputs if isinstance(item, torch.Tensor)]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextmanager
def serial() -> Iterator[None]:
    """torch on one thread: the harness's own small ops stall 1000x on a parallel pool when
    another process holds a core (seen on the shared dev box: 58 ms vs 0.05 ms per sum)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# Secret weights: odd 63-bit integers drawn from the entropy the measuring path bound at import
# (`timing.draw`), never from torch's generator a variant can seed; one vector per (kind, length).
_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}
_PERIOD = 4096  # an input's bits are read as rows of this many: a column and a row weight each
_BLOCK_ROWS = 256  # rows per pass: an 8 MiB int64 product, reused
_STACKED_NUMEL = 8 * _PERIOD
"""Inputs of at most this many elements are checksummed stacked across sets (`_stacked_sums`):
per tensor, 4096 sets of 64 elements read at 0.01 GB/s here, stacked at 0.3 GB/s; above 32K
elements one tensor at a time is the faster (1.8 against 1.4 GB/s at 64K)."""


def _weights(kind: str, count: int) -> torch.Tensor:
    """`count` secret odd weights of one kind ("column" or "row"), made once per length."""
    if (kind, count) not in _WEIGHTS:
        generator = torch.Generator().manual_seed(draw(2**63))
        drawn = torch.randint(-(2**62), 2**62, (count,), dtype=torch.int64, generator=generator)
        _WEIGHTS[kind, count] = drawn * 2 + 1
    return _WEIGHTS[kind, count]


def _weighted_sum(bits: torch.Tensor) -> int:
    """sum over i of row[i // P] * column[i % P] * bits[i], modulo 2^64, for the flat integer
    view `bits`: two secret odd weights per position, so a changed value, a +1/-1 ulp pair or
    a swap of two elements keeps it only by chance. Read in blocks through one reused product
    buffer (no copy of the input's size, weights of a few KiB)."""
    if not rules.on("weighted_checksum"):
        return int(bits.sum())
    rows, tail = divmod(bits.numel(), _PERIOD)
    device = bits.device
    column, row = _weights("column", _PERIOD).to(device), _weights("row", rows + 1).to(device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    grid = bits[: rows * _PERIOD].view(rows, _PERIOD)
    product = torch.empty((min(rows, _BLOCK_ROWS), _PERIOD), dtype=torch.int64, device=device)
    for start in range(0, rows, _BLOCK_ROWS):
        block = grid[start:start + _BLOCK_ROWS]
        out = product[: block.shape[0]]
        torch.mul(block, column, out=out)
        total += (out.sum(1) * row[start:start + block.shape[0]]).sum()
    if tail:
        total += (bits[rows * _PERIOD:].to(torch.int64) * column[:tail]).sum() * row[rows]
    return int(total)


def _position_weights(count: int) -> torch.Tensor:
    """row[i // P] * column[i % P] for the first `count` positions: `_weighted_sum`'s weights
    written out, for tensors small enough to weight in one product."""
    rows = count // _PERIOD + 1
    weights = _weights("row", rows).repeat_interleave(_PERIOD)[:count]
    return weights * _weights("column", _PERIOD).repeat(rows)[:count]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns as a flat integer view (no copy)."""
    return tensor.detach().reshape(-1).view(_BITS[tensor.element_size()])


def _stacked_sums(tensors: list[torch.Tensor]) -> list[int]:
    """`_weighted_sum` of each of these small tensors of one size, stacked in chunks of about
    _BLOCK_ROWS x _PERIOD elements: the same sums modulo 2^64, a few torch calls per chunk
    instead of a dozen per tensor (a cold rotation of a small shape has thousands of sets)."""
    count = tensors[0].numel()
    weights = _position_weights(count) if rules.on("weighted_checksum") else None
    per_chunk = max(1, _BLOCK_ROWS * _PERIOD // max(count, 1))
    sums: list[int] = []
    for start in range(0, len(tensors), per_chunk):
        with torch.no_grad():
            chunk = torch.stack(tensors[start:start + per_chunk])
        bits = _BITS[chunk.element_size()]
        grid = chunk.reshape(chunk.shape[0], -1).view(bits).to(torch.int64)
        if weights is not None:
            grid.mul_(weights.to(grid.device))
        sums += grid.sum(1).tolist()
    return sums


def _checksums(sets: list[Inputs]) -> list[list[int]]:
    """Each set's checksums: every input's bit patterns, weighted by secret per-position
    weights and summed (`_weighted_sum`), with no float64 copy. Inputs at one position that
    are small and alike across sets are summed together (`_stacked_sums`)."""
    columns = list(zip(*(tensors_in(inputs) for inputs in sets), strict=True))
    by_column: list[list[int]] = []
    with serial():
        for tensors in columns:
            alike = {(t.numel(), t.element_size()) for t in tensors}
            if len(alike) == 1 and tensors[0].numel() <= _STACKED_NUMEL:
                by_column.append(_stacked_sums(list(tensors)))
            else:
                by_column.append([_weighted_sum(_bits(t)) for t in tensors])
    return [list(row) for row in zip(*by_column, strict=True)] if columns else [[] for _ in sets]


@dataclass
class InputSets:
    """Input sets of one cell; set i is seeded with seed + i, its references computed lazily."""

    spec: OpSpec
    shape: Shape
    dtype: torch.dtype
    device: torch.device
    seed: int
    sets: list[Inputs] = field(default_factory=list)
    _references: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    _checksums: dict[int, list[int]] = field(default_factory=dict)

    def ensure(self, count: int) -> None:
        first = len(self.sets)
        while len(self.sets) < count:
            index = len(self.sets)
            self.sets.append(
                self.spec.make_inputs(self.shape, self.dtype, self.device, self.seed + index)
            )
        for index, sums in enumerate(_checksums(self.sets[first:]), start=first):
            self._checksums[index] = sums

    @property
    def bytes_per_set(self) -> int:
        self.ensure(1)
        return sum(t.numel() * t.element_size() for t in tensors_in(self.sets[0]))

    def reference(self, index: int) -> tuple[torch.Tensor, ...]:
        """The float64 reference of set `index` as generated (cached)."""
        if index not in self._references:
            self._references[index] = self.spec.reference(self.sets[index])
        return self._references[index]

    def cold_count(self, cache_bytes: int) -> tuple[int, str]:
        """How many sets a cache-cold rotation needs, and a note when it could not be reached."""
        per_set = max(self.bytes_per_set, 1)
        wanted = math.ceil(COLD_FACTOR * cache_bytes / per_set)
        allowed = min(MAX_COLD_SETS, max(1, MAX_ROTATION_BYTES // per_set))
        if wanted <= WARM_SETS:
            return WARM_SETS, "the warm rotation already exceeds the cache"
        if wanted > allowed:
            reached = allowed * per_set
            return (
                allowed,
                f"capped at {reached / 2**20:.0f} MiB, {reached / cache_bytes:.1f}x cache",
            )
        return wanted, ""

    def modified(self, count: int) -> list[int]:
        """Sets among the first `count` whose values no longer match their checksum."""
        now = _checksums(self.sets[:count])
        return [i for i, sums in enumerate(now) if sums != self._checksums[i]]


class InputCache:
    """Input sets kept across the trials of one cell in a worker (inputs cost harness time)."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._sets: InputSets | None = None

    def get(
        self, spec: OpSpec, shape: Shape, dtype: torch.dtype, device: torch.device, seed: int
    ) -> InputSets:
        key = (spec.name, shape, dtype, str(device), seed)
        if self._sets is None or key != self._key:
            self._key, self._sets = key, InputSets(spec, shape, dtype, device, seed)
        return self._sets

    def drop(self) -> None:
        """Forget the sets (a variant changed them, as in-place variants do)."""
        self._key, self._sets = None, None
