"""Interleaved re-measurement: an in-place contender never disturbs the others' inputs."""

from __future__ import annotations

from conftest import cpu_cell

from fusionlab.measure.rounds import RoundsTask
from fusionlab.measure.timing import TimingSettings
from fusionlab.records import Status

_QUICK = TimingSettings(warmup_s=0.0, budget_s=0.005, min_samples=3, max_samples=5)


def _rounds(contenders: list[str], rounds: int = 3) -> dict:
    task = RoundsTask(
        cell=cpu_cell("add_rmsnorm", (8, 256)),
        contenders=[(name, name, {}) for name in contenders],
        mode="warm",
        rounds=rounds,
        timing=_QUICK,
    )
    return task.run()


def test_in_place_contender_beside_out_of_place_ones() -> None:
    # The in-place variant overwrites x and the residual with every call; the naive and built-in
    # contenders are timed between its calls and checked against their references each round.
    outcome = _rounds(["naive", "builtin-inplace", "builtin"])
    for name, entry in outcome.items():
        assert entry["status"] == Status.PASSED.value, (name, entry["message"])
        assert len(entry["rounds"]) == 3


def test_in_place_contender_first_in_the_order() -> None:
    outcome = _rounds(["builtin-inplace", "naive"], rounds=2)
    assert all(entry["status"] == Status.PASSED.value for entry in outcome.values()), outcome
