"""Claim-protocol load on PostgreSQL (loopback): (a) coordination cost per trial with 1, 2 and 4
worker processes (claim + replay params + a few-KB result user attr, measuring nothing), median ms;
(b) 32 workers claiming a 2000-configuration study: every configuration claimed exactly once,
claims per second. Bounded in count and time.

    python benchmarks/claims_load.py [--url URL]   # no URL: starts its own .ci/postgres.sh cluster

Workers load search/claims.py by path (it needs only optuna and sqlalchemy), so 32 of them do not
each import torch through the fusionlab package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORD = {"timing": {"samples_ms": [0.0123 + i * 1e-5 for i in range(200)]}, "note": "x" * 200}
DEADLINE_S = 240.0  # every worker stops by itself after this, finished or not


def _claims() -> Any:
    if "claims" in sys.modules:
        return sys.modules["claims"]
    spec = importlib.util.spec_from_file_location("claims", ROOT / "search" / "claims.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["claims"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _configs(n: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        (json.dumps({"variant": "v", "params": {"x": x}}), {"variant": "v", "v.x": x})
        for x in range(n)
    ]


def _worker(url: str, name: str, n: int, barrier: Any, out: Any) -> None:
    """Child: claim until nothing waits (or the deadline); report per-trial seconds."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    claims = _claims()
    study = optuna.load_study(
        study_name=name,
        storage=optuna.storages.RDBStorage(url),
        sampler=optuna.samplers.RandomSampler(),
    )
    worker, lease = claims.worker_name(), claims.Lease(seconds=120.0, renew_s=30.0)
    barrier.wait(timeout=180)
    stop_at, durations, keys = time.monotonic() + DEADLINE_S, [], []
    while time.monotonic() < stop_at:
        start = time.perf_counter()
        claim = claims.claim_next(study, worker, lease)
        if claim is None:
            break
        claim.trial.suggest_categorical("variant", ["v"])
        x = claim.trial.suggest_int("v.x", 0, n - 1)
        claim.finish(float(x), {"record": RECORD})
        durations.append(time.perf_counter() - start)
        keys.append(claim.key)
    out.put((durations, keys))


def _run(url: str, workers: int, n: int) -> tuple[list[float], list[str], float, float]:
    """Plan a fresh study of n configs, run the workers together; (durations, keys, plan s, s)."""
    import optuna

    claims = _claims()
    name = f"load-{uuid.uuid4().hex[:8]}"
    study = optuna.create_study(storage=optuna.storages.RDBStorage(url), study_name=name)
    start = time.perf_counter()
    claims.plan_cell(study, _configs(n))
    plan_s = time.perf_counter() - start
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(workers + 1), context.Queue()
    procs = [
        context.Process(target=_worker, args=(url, name, n, barrier, out)) for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    barrier.wait(timeout=180)
    start = time.perf_counter()
    results = [out.get(timeout=DEADLINE_S + 60) for _ in procs]
    wall = time.perf_counter() - start
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    durations = [d for result in results for d in result[0]]
    keys = [k for result in results for k in result[1]]
    return durations, keys, plan_s, wall


def _check_once(keys: list[str], n: int) -> None:
    expected = sorted(key for key, _ in _configs(n))
    assert sorted(keys) == expected, f"{len(keys)} claims for {n} configurations"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", help="PostgreSQL URL (default: a throw-away .ci/postgres.sh cluster)"
    )
    parser.add_argument("--trials", type=int, default=120, help="configurations per run in (a)")
    parser.add_argument("--load-configs", type=int, default=2000)
    parser.add_argument("--load-workers", type=int, default=32)
    args = parser.parse_args()
    env = {**os.environ, "FUSIONLAB_PG_DIR": f"/tmp/fusionlab-pg-bench-{uuid.uuid4().hex[:8]}"}
    script = [str(ROOT / ".ci" / "postgres.sh")]
    url = (
        args.url
        or subprocess.run(
            [*script, "start"], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    try:
        sys.path.insert(0, str(ROOT))
        from fusionlab.search.storage import open_storage

        open_storage(url)  # creates Optuna's tables once, under the advisory lock
        print(
            "(a) coordination cost per trial: claim + replay 2 params + finish with a "
            f"{len(json.dumps(RECORD)) / 1024:.1f} KB record, {args.trials} configurations"
        )
        for workers in (1, 2, 4):
            durations, keys, _, wall = _run(url, workers, args.trials)
            _check_once(keys, args.trials)
            print(
                f"  {workers} worker(s): median {statistics.median(durations) * 1e3:.1f} ms/trial, "
                f"p90 {statistics.quantiles(durations, n=10)[-1] * 1e3:.1f} ms, "
                f"{len(keys) / wall:.0f} trials/s overall"
            )
        n, workers = args.load_configs, args.load_workers
        durations, keys, plan_s, wall = _run(url, workers, n)
        _check_once(keys, n)
        print(
            f"(b) {workers} workers, {n} configurations: each claimed exactly once; "
            f"{len(keys) / wall:.0f} claims/s, {wall:.1f} s claiming "
            f"(+ {plan_s:.1f} s planning by one process), "
            f"median {statistics.median(durations) * 1e3:.1f} ms per claim+finish"
        )
    finally:
        if not args.url:
            subprocess.run([*script, "stop"], env=env, check=False)


if __name__ == "__main__":
    main()
