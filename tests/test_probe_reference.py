"""The refill probe's reference: for the row-wise built-in ops, the set's own reference with the
changed row recomputed equals the reference of the whole changed set; an op that does not
declare itself row-wise gets the whole set recomputed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusionlab.measure.inputs import InputSets
from fusionlab.measure.probe import Probe
from fusionlab.registry import get_op


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm", "add_layernorm"])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 40)], ids=str)
def test_one_row_recomputed_equals_the_whole_changed_set(op, shape):
    spec = get_op(op)
    assert spec.rowwise
    sets = InputSets(spec, shape, torch.float32, torch.device("cpu"), seed=3)
    sets.ensure(2)
    probe = Probe(sets.sets[:2])
    for _ in range(4):  # several drawn places; referenced after the restore, as the trial does
        probe.alter(1)
        probe.restore()
        base = [out.clone() for out in sets.reference(1)]
        want = spec.reference(probe.altered())
        changed = probe.reference(spec, sets.reference)
        row = probe.position // shape[-1]
        for new, whole in zip(changed.rows, want, strict=True):  # the row alone, as the probe's
            torch.testing.assert_close(new, whole.reshape(-1, shape[-1])[row:row + 1],
                                       rtol=1e-12, atol=1e-12)
        for old, whole in zip(changed.old_rows, base, strict=True):
            torch.testing.assert_close(old, whole.reshape(-1, shape[-1])[row:row + 1],
                                       rtol=1e-12, atol=1e-12)
        with changed.swapped() as got:
            assert any(not torch.equal(g, b) for g, b in zip(got, base, strict=True))
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        for kept, b in zip(sets.reference(1), base, strict=True):  # the cached one restored
            assert torch.equal(kept, b)


def test_an_op_not_declared_row_wise_is_recomputed_whole():
    calls = []
    rmsnorm = get_op("rmsnorm")

    def counting_reference(inputs):
        calls.append(tuple(inputs[0].shape))
        return rmsnorm.reference(inputs)

    spec = dataclasses.replace(rmsnorm, rowwise=False, reference=counting_reference)
    sets = InputSets(spec, (4, 64), torch.float32, torch.device("cpu"), seed=3)
    sets.ensure(1)
    probe = Probe(sets.sets[:1])
    probe.alter(0)
    probe.restore()
    with probe.reference(spec, sets.reference).swapped() as got:
        torch.testing.assert_close(got[0], rmsnorm.reference(probe.altered())[0])
    assert calls == [(4, 64)]
