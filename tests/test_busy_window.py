"""The disturbance a trial record keeps is a typed BusyWindow, stored as it always was: a record
without a readable window still stores `{}`, and records stored before it was typed load."""

from __future__ import annotations

import json

import pytest
from conftest import cpu_cell

from fusionlab.measure import disturbance
from fusionlab.records import BusyWindow, Status, TrialRecord
from fusionlab.schema import SchemaError


def _record(**extra) -> dict:
    return {**TrialRecord(cpu_cell("rmsnorm", (8, 256)), "naive", {}, Status.PASSED).to_dict(),
            **extra}


def test_a_record_without_a_window_stores_an_empty_object_and_reads_none() -> None:
    data = _record()
    assert data["disturbance"] == {}
    record = TrialRecord.from_dict(json.loads(json.dumps(data)))
    assert record.disturbance is None
    assert record.to_json() == TrialRecord.from_dict(data).to_json()


def test_a_stored_window_reads_back_typed_and_stores_the_same_bytes() -> None:
    window = {"wall_s": 0.5, "other_cpu_s": 0.4, "other_share": 0.4, "load": 2.5,
              "mhz": None, "disturbed": True, "attempts": 3}
    data = _record(disturbance=window)
    record = TrialRecord.from_dict(data)
    assert record.disturbance == BusyWindow(0.5, 0.4, 0.4, 2.5, None, True, 3)
    assert json.loads(record.to_json())["disturbance"] == window
    line = disturbance.summary([record.disturbance], ["8x256 float32"])
    assert line is not None and "40%" in line and "8x256 float32" in line


def test_a_window_missing_a_figure_is_refused_naming_it() -> None:
    with pytest.raises(SchemaError, match=r"disturbance\.other_share"):
        TrialRecord.from_dict(_record(disturbance={"wall_s": 0.5, "other_cpu_s": 0.4,
                                                   "load": 1.0, "mhz": None,
                                                   "disturbed": False}))


def test_a_watched_window_becomes_the_record_kind() -> None:
    seen = disturbance.Watch().stop()
    if seen is None:
        pytest.skip("no /proc/stat here")
    kept = disturbance.window_of(seen.to_dict(), 2)
    assert kept == BusyWindow(**{**seen.to_dict(), "attempts": 2})
    assert seen.window().attempts == 1 and seen.window().disturbed == seen.disturbed
    assert disturbance.window_of({}, 1) is None
