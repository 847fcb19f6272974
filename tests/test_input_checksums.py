"""Input-set checksums: the stacked path that sums thousands of small sets together gives each
set the same checksum as the one-tensor weighted sum, and still finds one changed, swapped or
ulp-shifted set among thousands (what a cold rotation of a small shape holds)."""

from __future__ import annotations

import pytest
import torch

from fusionlab.measure import inputs
from fusionlab.measure.inputs import InputSets
from fusionlab.registry import get_op

PERIOD, BLOCK = inputs._PERIOD, inputs._PERIOD * inputs._BLOCK_ROWS
STACKED = inputs._STACKED_NUMEL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
@pytest.mark.parametrize(
    "numel", [1, 7, 64, PERIOD, PERIOD + 1, 3 * PERIOD + 5, STACKED, STACKED + 1, BLOCK]
)
def test_stacked_sums_equal_each_tensors_weighted_sum(dtype, numel) -> None:
    generator = torch.Generator().manual_seed(numel)
    tensors = [(torch.randn(numel, generator=generator) * 50).to(dtype) for _ in range(5)]
    tensors.append((torch.randn(numel, 3, generator=generator) * 50).to(dtype)[:, 1])  # strided
    alone = [inputs._weighted_sum(inputs._bits(t)) for t in tensors]
    assert inputs._stacked_sums(tensors) == alone
    assert len(set(alone)) == len(alone)  # different values, different sums


def _sets(shape: tuple[int, int], count: int) -> InputSets:
    sets = InputSets(get_op("rmsnorm"), shape, torch.float32, torch.device("cpu"), 3)
    sets.ensure(count)
    return sets


def tensors_of(sets: InputSets, index: int) -> list[torch.Tensor]:
    return inputs.tensors_in(sets.sets[index])


@pytest.mark.parametrize(("shape", "count"), [((2, 64), 3000), ((4, 3 * STACKED // 4), 6)])
def test_one_changed_set_among_many_is_found(shape, count) -> None:
    """Stacked (thousands of small sets) and one at a time (a few large ones)."""
    sets = _sets(shape, count)
    assert sets.modified(count) == []
    x = tensors_of(sets, count // 2)[0]
    x.view(torch.int32)[1, 5] += 1  # one ulp in one set
    y = tensors_of(sets, count - 1)[0]
    y[0, 3], y[0, 4] = y[0, 4].item(), y[0, 3].item()  # a swap of two elements
    assert sets.modified(count) == [count // 2, count - 1]
    assert sets.modified(count - 1) == [count // 2]


def test_mixed_sizes_across_sets_fall_back_to_one_sum_each() -> None:
    small = [torch.randn(64), torch.randn(65)]
    assert inputs._checksums([(small[0],), (small[1],)]) == [
        [inputs._weighted_sum(inputs._bits(small[0]))],
        [inputs._weighted_sum(inputs._bits(small[1]))],
    ]
