"""More of the command as a user runs it: compare, Ctrl-C, entry points."""

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from conftest import PLUGINS, interruptible, run_cli
from helpers import sqlite_url


def test_compare_prints_tables_verdicts_and_writes_traces(tmp_path: Path) -> None:
    result = run_cli("compare", "rmsnorm", "--shape", "4x64", "--variants", "naive,builtin",
                     "--trace-dir", "traces", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("Self CPU") >= 2  # one key_averages table per variant
    assert "schedule(wait=1, warmup=2, active=5)" in out
    assert "naive: 6 device ops per call (aten::mul x3)" in out
    assert "builtin: 1 device op per call (aten::rms_norm)" in out
    traces = sorted((tmp_path / "traces").glob("*.json"))
    assert [t.name for t in traces] == ["rmsnorm_builtin_4x64_float32.json",
                                        "rmsnorm_naive_4x64_float32.json"]
    assert all(str(t) in out for t in traces)
    assert json.loads(traces[1].read_text())["traceEvents"]


def test_ctrl_c_stops_cleanly_and_keeps_what_was_measured(tmp_path: Path) -> None:
    db = tmp_path / "results.db"
    command = [sys.executable, "-m", "fusionlab.cli", "sweep", "rmsnorm", "--quick",
               "--shapes", "2x64", "--variants", "naive,hangs", "--plugin",
               str(PLUGINS / "misbehaving.py"), "--storage", sqlite_url(db)]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    assert process.stderr is not None
    # One runner claims in the plan's order: naive is stored first, then `hangs` runs.
    for line in process.stderr:
        if "] 2x64" in line:
            assert "naive" in line, line
            break
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    with sqlite3.connect(db) as connection:
        states = [row[0] for row in connection.execute("select state from trials")]
    assert states.count("COMPLETE") == 1 and "RUNNING" not in states
    resumed = run_cli(*command[3:-4], "--variants", "naive", "--storage", sqlite_url(db),
                      cwd=tmp_path)
    assert resumed.returncode == 0 and "] 2x64" not in resumed.stderr


def test_entry_point_variants_join_the_registry(tmp_path: Path) -> None:
    dist = tmp_path / "fusionlab_extra-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fusionlab-extra\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fusionlab.variants]\nextra = extra_variants\n")
    (tmp_path / "extra_variants.py").write_text(
        "from fusionlab import register_variant\n"
        "from fusionlab.kernels.rmsnorm.framework import builtin_rmsnorm\n"
        "@register_variant('rmsnorm', 'from-entry-point', devices=('cpu',))\n"
        "def from_entry_point(device_type):\n"
        "    '''Registered through an installed package.'''\n"
        "    return builtin_rmsnorm\n"
    )
    env_command = [sys.executable, "-c",
                   f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
                   "from fusionlab.cli import main; sys.exit(main(['list', '--wide']))"]
    result = subprocess.run(env_command, capture_output=True, text=True, check=False,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "from-entry-point" in result.stdout and "Registered through an" in result.stdout
