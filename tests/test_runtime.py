"""Using the winners at runtime: exact, nearest and fallback dispatch, with correct results."""

from pathlib import Path

import torch

from fusionlab import Dispatcher, sweep
from fusionlab.measure.timing import TimingSettings
from fusionlab.registry import get_op, get_variant
from fusionlab.report.winners import cell_winner

FAST = TimingSettings(warmup_s=0.005, budget_s=0.02, min_samples=3, max_samples=10)


def test_dispatcher_uses_the_stored_winner(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runtime.db'}"
    cells = sweep("rmsnorm", "4x64,64x64", "float32", device="cpu", storage=url,
                  variants=["naive", "builtin"], timing=FAST)
    dispatch = Dispatcher("rmsnorm", storage=url)
    spec = get_op("rmsnorm")
    winners = {cell.cell.shape: cell_winner(cell).record.variant for cell in cells}
    decisions = {cell.cell.shape: cell_winner(cell).decision for cell in cells}

    exact = dispatch.choose((4, 64), torch.float32, "cpu")
    assert (exact.variant, exact.match) == (winners[(4, 64)], "exact")
    assert exact.decision == decisions[(4, 64)]
    assert exact.decision in {"faster", "equivalent", "inconclusive"}
    nearest = dispatch.choose((2, 40, 64), torch.float32, "cpu")
    assert (nearest.variant, nearest.match) == (winners[(64, 64)], "nearest")
    assert dispatch.choose((4, 128), torch.float32, "cpu").match == "fallback"
    assert dispatch.choose((4, 64), torch.bfloat16, "cpu").match == "fallback"

    for shape in [(4, 64), (2, 40, 64), (4, 128)]:
        inputs = spec.make_inputs(shape, torch.float32, torch.device("cpu"), 5)
        torch.testing.assert_close(dispatch(*inputs).double(), spec.reference(inputs)[0],
                                   atol=1e-4, rtol=1e-4)


def test_many_compiled_kernels_never_fall_back_to_eager() -> None:
    variant = get_variant("rmsnorm", "compiled")
    spec = get_op("rmsnorm")
    kernels = []
    for rows in range(1, 11):  # more shapes than dynamo's recompile limit of 8
        kernel = variant.factory("cpu", mode="default", dynamic=False)
        inputs = spec.make_inputs((rows, 32), torch.float32, torch.device("cpu"), rows)
        kernel(*inputs)
        kernels.append((kernel, inputs))
    last, inputs = kernels[-1]
    with torch.profiler.profile() as prof:
        last(*inputs)
    assert any(e.name.startswith("Torch-Compiled Region") for e in prof.events())
    assert not any(e.name == "aten::mul" for e in prof.events())
