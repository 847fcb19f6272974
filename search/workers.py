"""Many workers on one storage: local workers started by `sweep --workers N` (one per device),
workers that join a planned sweep from any host (`fusionlab worker`), and where a sweep stands
(`fusionlab status`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import optuna
from optuna.storages import BaseStorage

from fusionlab.cell import Cell
from fusionlab.devices import Device, unavailable_reason
from fusionlab.errors import UserError
from fusionlab.plan import StoredPlan, SweepPlan
from fusionlab.search import claims
from fusionlab.search import results_store as store
from fusionlab.search.runner import lease_from_env, measured_count
from fusionlab.search.storage import is_parallel_safe

CORES_ENV = "FUSIONLAB_CPU_CORES"  # a pinned CPU worker's cores, e.g. "0,1"

CPU_SHARING_NOTE = (
    "{count} workers share this CPU: each one's timing is disturbed by the others' work, so "
    "numbers are not comparable with a one-worker sweep; --pin gives each worker its own cores "
    "(memory bandwidth and the last-level cache stay shared)"
)


def check_worker_count(device: Device, count: int, pin: bool, url: str) -> str | None:
    """Refuse what cannot work; returns a warning to print for what works but disturbs timing."""
    if count < 1:
        raise UserError(f"--workers must be at least 1 (got {count})")
    if pin and device.type != "cpu":
        raise UserError("--pin only applies to cpu workers (other devices get one device each)")
    if count == 1:
        return None
    unsafe = is_parallel_safe(url)
    if unsafe:
        raise UserError(unsafe)
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0))
        if pin and count > cores:
            raise UserError(f"--pin needs a core per worker: {count} workers, {cores} cores here")
        return None if pin else CPU_SHARING_NOTE.format(count=count)
    available = device.device_count()
    if count > available:
        raise UserError(
            f"--workers {count} needs {count} {device.type} devices and {available} are visible "
            "here: lower --workers"
        )
    return None


def worker_envs(device: Device, count: int, pin: bool) -> list[dict[str, str]]:
    """Environment for each local worker: its own device, or its own CPU cores when pinned."""
    if device.type != "cpu":
        return [device.visible_env(index) for index in range(count)]
    if not pin:
        return [{} for _ in range(count)]
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // count
    return [
        {CORES_ENV: ",".join(str(c) for c in cores[index * share : (index + 1) * share])}
        for index in range(count)
    ]


def pin_to_env_cores() -> None:
    """Run on the cores named in FUSIONLAB_CPU_CORES (children inherit them), with as many
    threads as cores."""
    text = os.environ.get(CORES_ENV)
    if not text:
        return
    cores = {int(core) for core in text.split(",")}
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    import torch

    torch.set_num_threads(len(cores))


def start_local_workers(
    url: str, plan: SweepPlan, count: int, pin: bool
) -> list[subprocess.Popen]:
    """`fusionlab worker` processes on this host, one per device (or core group), that work
    on this plan alone (another sweep's work in the same storage is left to its own workers)."""
    ident = store.plan_id(StoredPlan.of(plan))
    command = [sys.executable, "-m", "fusionlab.cli", "worker", "--storage", url, "--op",
               plan.op, "--plan", ident]
    device = plan.device
    return [
        subprocess.Popen(command, env={**os.environ, **env})
        for env in worker_envs(device, count, pin)
    ]


def joinable_plans(
    storage: BaseStorage,
    url: str,
    op: str | None,
    note: Callable[[str], None],
    plan_id: str | None = None,
) -> list[SweepPlan]:
    """Every sweep planned in the storage that this host can measure (only the plan `plan_id`
    when given); says why it skips others."""
    unsafe = is_parallel_safe(url)
    if unsafe:
        raise UserError(unsafe)
    by_plan: dict[str, list[Cell]] = {}
    plans: dict[str, StoredPlan] = {}
    for cell, plan in store.planned_cells(storage):
        key = store.plan_id(plan)
        if (op is None or cell.op == op) and plan_id in (None, key):
            plans[key] = plan
            by_plan.setdefault(key, []).append(cell)
    if not plans:
        what = f"of {op} " if op else ""
        raise UserError(
            f"no sweep {what}is planned in {url}: start one with `fusionlab sweep OP --storage "
            f"{url}`, then join it"
        )
    joined = []
    finished = 0
    for key, stored in plans.items():
        reason = unavailable_reason(stored.device)
        if reason is not None:
            note(f"skipping the {stored.op} sweep on {stored.device}: {reason}")
            continue
        # Joining all, a worker leaves alone the cells of sweeps with nothing left to claim (a
        # sweep's own workers, given its plan, still finish its re-measurements).
        if plan_id is None and not any(_has_work(storage, c) for c in by_plan[key]):
            finished += 1
            continue
        plan = stored.plan()
        here = plan.cells()
        mine = {store.study_name(c) for c in here}
        if not any(store.study_name(c) in mine for c in by_plan[key]):
            sample = by_plan[key][0]
            note(
                f"skipping the {stored.op} sweep on {sample.device_name}: this host is "
                f"{plan.device.hardware_name()} with toolchain {here[0].toolchain_id}, "
                f"the sweep's is {sample.toolchain_id}; install the same versions to join it"
            )
            continue
        joined.append(plan)
    if finished:
        note(f"{finished} finished sweep(s) left alone: nothing waits in their cells")
    if not joined and finished < len(plans):
        raise UserError(f"nothing in {url} can be measured on this host (see the notes above)")
    return joined


def _has_work(storage: BaseStorage, cell: Cell) -> bool:
    study = optuna.load_study(study_name=store.study_name(cell), storage=storage)
    return claims.has_work(study)


def status_rows(storage: BaseStorage, op: str | None) -> list[dict[str, object]]:
    """One row per planned cell: measured, running (by whom), waiting, verdict."""
    rows = []
    lease = lease_from_env()
    seen: set[str] = set()
    for cell, plan in store.planned_cells(storage):
        if (op is not None and cell.op != op) or store.study_name(cell) in seen:
            continue
        seen.add(store.study_name(cell))
        study = optuna.load_study(study_name=store.study_name(cell), storage=storage)
        status = claims.status(study, lease)
        verdict = store.verdicts_of(study.user_attrs).get(plan.rank_by)
        running = ", ".join(
            [f"{worker} ({n})" for worker, n in sorted(status.running.items())]
            + [f"{worker} ({n}, lease expired)" for worker, n in sorted(status.expired.items())]
        )
        rows.append(
            {
                "op": cell.op,
                "device": cell.device_name,
                "cell": cell.label,
                "measured": measured_count(study),
                "running": running or "-",
                "waiting": status.waiting,
                "verdict": verdict.winner if verdict else "-",
            }
        )
    return rows
