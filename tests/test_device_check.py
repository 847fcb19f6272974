"""benchmarks/device_check.py without an accelerator: arguments, plan, steps, no-device exit."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "device_check.py"
spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
device_check = importlib.util.module_from_spec(spec)
sys.modules["device_check"] = device_check  # dataclasses resolve their module by name
spec.loader.exec_module(device_check)


def test_defaults_and_options():
    args = device_check.parse_args([])
    assert (args.device, args.out, args.budget, args.tail) == ("auto", None, 290.0, 40)
    args = device_check.parse_args(["--device", "cuda", "--out", "r.md", "--budget", "60"])
    assert (args.device, args.out, args.budget) == ("cuda", Path("r.md"), 60.0)


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--budget", "0"], ["--tail", "0"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        device_check.parse_args(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err


@pytest.mark.skipif(device_check.detect_device() is not None, reason="an accelerator is present")
@pytest.mark.parametrize("device", ["auto", "cuda", "neuron"])
def test_no_device_says_so_in_one_line_and_exits_2(device, tmp_path):
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", device, "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "nothing to check" in done.stderr
    assert not out.exists()


def test_cuda_plan_runs_cuda_tests_sweeps_and_bandwidth():
    steps = device_check.plan("cuda", ["rmsnorm", "add_rmsnorm"], "sqlite:////tmp/x.db")
    commands = [" ".join(s.cmd) for s in steps]
    assert commands[0].endswith("-m pytest -q -m cuda")
    assert "sweep rmsnorm --device cuda --shapes 1x4096,2048x8192 --dtypes bfloat16" in commands[1]
    assert "sweep add_rmsnorm" in commands[2] and "--storage sqlite:////tmp/x.db" in commands[2]
    assert "bandwidth.py --device cuda" in commands[3]
    assert len(steps) == 4


def test_neuron_plan_has_no_bandwidth_step():
    steps = device_check.plan("neuron", ["rmsnorm"], "sqlite:////tmp/x.db")
    assert [s.name for s in steps] == ["tests -m neuron", "sweep rmsnorm"]
    assert "--device neuron" in " ".join(steps[1].cmd)


def test_registered_ops_from_the_list_table():
    table = "| op | variant |\n| rmsnorm | naive |\n|         |   |\n| add_rmsnorm | triton |\n"
    assert device_check.registered_ops(table) == ["rmsnorm", "add_rmsnorm"]


def test_run_step_records_exit_code_tail_and_timeouts():
    far = time.monotonic() + 60
    ok = device_check.run_step(
        device_check.Step("ok", (sys.executable, "-c", "print(1); print(2); print(3)"), 30), far, 2
    )
    assert (ok.returncode, ok.tail) == (0, "2\n3")
    slow = device_check.Step("slow", (sys.executable, "-c", "import time; time.sleep(30)"), 1.5)
    timed_out = device_check.run_step(slow, far, 5)
    assert timed_out.returncode is None and "timed out" in timed_out.tail
    assert timed_out.seconds < 10
    skipped = device_check.run_step(slow, time.monotonic(), 5)
    assert skipped.returncode is None and "skipped" in skipped.tail


def test_report_lists_every_step():
    step = device_check.Step("tests -m cuda", ("python", "-m", "pytest"), 120)
    results = [device_check.Result(step, 0, 12.5, "3 passed"),
               device_check.Result(step, None, 120.0, "timed out")]
    report = device_check.render("cuda", {"torch": "2.13.0"}, results)
    assert "# Device check: cuda" in report and "| torch | 2.13.0 |" in report
    assert "`python -m pytest`" in report and "3 passed" in report
    assert "| tests -m cuda | 0 | 12.5 |" in report
    assert "| tests -m cuda | timeout | 120.0 |" in report
