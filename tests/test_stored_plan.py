"""The sweep plan stored beside its cells: versioned like every stored record, read back by
attribute, an older plan migrated, a foreign one refused with one line (exit 2 at the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys

import optuna
import pytest
from conftest import cpu_cell

from fusionlab.measure.rounds import StopRule
from fusionlab.plan import Confirm, StoredPlan, make_plan
from fusionlab.schema import SCHEMA_VERSION, SchemaError
from fusionlab.search import results_store as store
from fusionlab.search.storage import open_storage


def _plan():
    rule = StopRule(min_rounds=3, max_rounds=9, budget_s=1.5)
    plan = make_plan("rmsnorm", "8x256,4x128", "float32", "cpu", "naive,builtin", trials=7,
                     seed=3, rank_by="warm", threads=1)
    return plan.__class__(**{**plan.__dict__, "confirm": Confirm(rule=rule, within=0.2)})


def test_a_plan_round_trips_through_its_stored_form() -> None:
    plan = _plan()
    data = json.loads(json.dumps(StoredPlan.of(plan).to_dict()))
    assert data["schema"] == SCHEMA_VERSION
    assert data["confirm"]["rule"] == {"min_rounds": 3, "max_rounds": 9, "budget_s": 1.5}
    stored = StoredPlan.from_dict(data)
    assert stored.to_dict() == data
    again = stored.plan()
    assert (again.op, again.shapes, again.dtypes, again.variants) == (
        plan.op, plan.shapes, plan.dtypes, plan.variants)
    assert (again.trials, again.seed, again.rank_by, again.threads) == (7, 3, "warm", 1)
    assert again.confirm == plan.confirm and again.timing == plan.timing
    assert store.plan_id(stored) == store.plan_id(StoredPlan.of(plan))


def test_a_plan_stored_before_plans_had_a_version_is_migrated() -> None:
    current = StoredPlan.of(_plan()).to_dict()
    old = {k: v for k, v in current.items()
           if k not in ("schema", "threads", "allocator", "pass_name", "screen")}
    confirm = {k: v for k, v in current["confirm"].items() if k != "rule"}
    old["confirm"] = {**confirm, "min_rounds": 4, "max_rounds": 12, "budget_s": 2.0}
    stored = StoredPlan.from_dict(old)
    assert stored.confirm is not None
    assert stored.confirm.rule == StopRule(min_rounds=4, max_rounds=12, budget_s=2.0)
    assert stored.confirm.within == 0.2 and stored.screen is False and stored.threads == 0


@pytest.mark.parametrize("change, needle", [
    ({"schema": SCHEMA_VERSION + 1}, "newer fusionlab"),
    ({"op": None}, "field 'op' should be a string"),
    ({"confirm": {"rule": {"min_rounds": "5"}}}, "'confirm.rule.min_rounds' should be an integer"),
    ({"colour": "red"}, "field 'colour' is not part of schema"),
])
def test_a_foreign_plan_is_refused_naming_the_field(change: dict, needle: str) -> None:
    data = {**StoredPlan.of(_plan()).to_dict(), **change}
    with pytest.raises(SchemaError, match="sweep plan") as caught:
        StoredPlan.from_dict(data)
    assert needle in str(caught.value)


def test_status_over_a_foreign_plan_says_so_in_one_line(tmp_path) -> None:
    url = f"journal:{tmp_path / 'foreign.log'}"
    study = optuna.create_study(storage=open_storage(url), study_name="cell")
    store.write_cell(study, cpu_cell("rmsnorm", (8, 256)))
    study.set_user_attr(f"{store.PLAN_ATTR}:foreign", {"op": "rmsnorm", "shapes": ["8x256"]})
    result = subprocess.run([sys.executable, "-m", "fusionlab.cli", "status", "--storage", url],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "study 'cell'" in lines[0] and "sweep plan" in lines[0] and "missing" in lines[0]
