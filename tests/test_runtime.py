"""Using the winners at runtime: exact, nearest and fallback dispatch, with correct results."""

import json
from pathlib import Path

import torch
from conftest import PLUGINS, run_cli
from helpers import QUICK_TIMING as FAST
from helpers import sqlite_url

from fusionlab import Dispatcher, sweep
from fusionlab.registry import get_op, get_variant, load_plugin
from fusionlab.winners import cell_winner


def test_dispatcher_uses_the_stored_winner(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "runtime.db")
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


SHAPE_DEPENDENT = str(PLUGINS / "shape_dependent.py")


def test_dispatcher_picks_the_variant_known_to_win_each_shape(tmp_path: Path) -> None:
    """The plugin's variants are slow on purpose at few or at many rows, so the winner of each
    cell is known before the sweep; the Dispatcher (from storage and from an exported winners
    file) must pick it, build it, and return its correct result."""
    url = sqlite_url(tmp_path / "shapes.db")
    swept = run_cli("sweep", "rmsnorm", "--quick", "--plugin", SHAPE_DEPENDENT,
                    "--shapes", "4x64,64x64", "--dtypes", "float32",
                    "--variants", "slow-on-few-rows,slow-on-many-rows", "--storage", url,
                    cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr
    exported = run_cli("export", "rmsnorm", "--plugin", SHAPE_DEPENDENT, "--storage", url,
                       "--format", "json", "-o", "winners.json", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "winners.json").read_text())["rows"]
    spec = get_op("rmsnorm")
    known = {(4, 64): "slow-on-many-rows", (64, 64): "slow-on-few-rows"}
    load_plugin(SHAPE_DEPENDENT)
    for dispatch in (Dispatcher("rmsnorm", storage=url),
                     Dispatcher("rmsnorm", winners=str(tmp_path / "winners.json"))):
        for shape, winner in known.items():
            choice = dispatch.choose(shape, torch.float32, "cpu")
            assert (choice.variant, choice.match) == (winner, "exact")
        # 2 x 40 rows: nearest stored row count is 64, whose winner is slow at few rows.
        nearest = dispatch.choose((2, 40, 64), torch.float32, "cpu")
        assert (nearest.variant, nearest.match) == ("slow-on-few-rows", "nearest")
        for shape in [(4, 64), (64, 64), (2, 40, 64)]:
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
