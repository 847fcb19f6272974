"""One command for a borrowed accelerator: tests, a small sweep and bandwidth, into one report.

    python benchmarks/device_check.py [--device auto|cuda|neuron] [--out device-check-cuda.md]

On CUDA (an H200 lent for a few minutes): the CUDA-only tests (`pytest -m cuda`: the compiled
Triton kernels against float64), `fusionlab sweep` of every registered op of rmsnorm, layernorm,
add_rmsnorm at two shapes in bfloat16 into a throw-away SQLite file, and benchmarks/bandwidth.py.
On Trainium: the Neuron tests (`pytest -m neuron`) and the same small sweep. Each step has its
own timeout and the whole run a budget (default 290 s), so it ends within 5 minutes. The report
(markdown) gives the device, versions, and per step its command, exit code, duration and output
tail. With neither device present it says so in one line and exits 2; otherwise it exits 0 when
every step passed and 1 when one failed or timed out.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
SWEEP_SHAPES = "1x4096,2048x8192"
BANDWIDTH_SHAPES = "32x4096,2048x8192"


@dataclass(frozen=True)
class Step:
    """One command of the check and the most seconds it may take."""

    name: str
    cmd: tuple[str, ...]
    timeout: float


@dataclass(frozen=True)
class Result:
    """How a step ended: returncode None means it timed out (or was skipped for lack of time)."""

    step: Step
    returncode: int | None
    seconds: float
    tail: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --out defaults to device-check-<device>.md once the device is known."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "neuron"), default="auto")
    parser.add_argument("--out", type=Path, default=None, help="markdown report path")
    parser.add_argument("--budget", type=float, default=290.0, help="seconds for all steps")
    parser.add_argument("--tail", type=int, default=40, help="output lines kept per step")
    args = parser.parse_args(argv)
    if args.budget <= 0 or args.tail < 1:
        parser.error("--budget and --tail must be positive")
    return args


def neuron_present() -> bool:
    """torch-neuronx installed and a Neuron device node visible."""
    return importlib.util.find_spec("torch_neuronx") is not None and bool(glob.glob("/dev/neuron*"))


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def detect_device(requested: str = "auto") -> str | None:
    """The device to check: the requested one if present, else (auto) cuda, then neuron."""
    present = {"cuda": cuda_present, "neuron": neuron_present}
    order = ("cuda", "neuron") if requested == "auto" else (requested,)
    return next((device for device in order if present[device]()), None)


def registered_ops(list_output: str) -> list[str]:
    """The ops of OPS that `fusionlab list` shows, in OPS order."""
    shown = set(re.findall(r"^\|\s*([a-z_]+)\s*\|", list_output, flags=re.MULTILINE))
    return [op for op in OPS if op in shown]


def fusionlab(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "fusionlab.cli", *args)


def plan(device: str, ops: list[str], storage: str) -> list[Step]:
    """The steps after `fusionlab list`, for `device` and the ops it reported."""
    marker = "cuda" if device == "cuda" else "neuron"
    steps = [Step(f"tests -m {marker}", (sys.executable, "-m", "pytest", "-q", "-m", marker), 120)]
    for op in ops:
        sweep = fusionlab("sweep", op, "--device", device, "--shapes", SWEEP_SHAPES,
                          "--dtypes", "bfloat16", "--storage", storage)
        steps.append(Step(f"sweep {op}", sweep, 50))
    if device == "cuda":
        bandwidth = (sys.executable, str(REPO / "benchmarks" / "bandwidth.py"), "--device", "cuda",
                     "--shapes", BANDWIDTH_SHAPES, "--dtypes", "bfloat16", "--rounds", "2")
        steps.append(Step("bandwidth", bandwidth, 40))
    return steps


def run_step(step: Step, deadline: float, tail: int) -> Result:
    """Run `step` from the repository root within its timeout and the overall `deadline`."""
    budget = min(step.timeout, deadline - time.monotonic())
    if budget < 1:
        return Result(step, None, 0.0, "skipped: the overall budget is spent")
    start = time.monotonic()
    try:
        done = subprocess.run(step.cmd, cwd=REPO, capture_output=True, text=True, timeout=budget,
                              check=False)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        output = _text(exc.stdout) + _text(exc.stderr) + f"\ntimed out after {budget:.0f} s"
    lines = output.rstrip().splitlines()[-tail:]
    return Result(step, code, time.monotonic() - start, "\n".join(lines))


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def versions(device: str) -> dict[str, str]:
    """Python, platform, package versions and the accelerator's name."""
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("torch", "triton", "torch-neuronx", "neuronx-cc", "optuna"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    if device == "cuda":
        import torch

        found["gpu"] = torch.cuda.get_device_name(0)
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        found["cuda (torch build)"] = str(torch.version.cuda)
    return found


def render(device: str, found: dict[str, str], results: list[Result]) -> str:
    """The markdown report."""
    lines = [f"# Device check: {device}", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in found.items()]
    lines += ["", "| step | exit code | seconds |", "|---|---|---|"]
    lines += [f"| {r.step.name} | {_code(r)} | {r.seconds:.1f} |" for r in results]
    for r in results:
        lines += ["", f"## {r.step.name}", "", f"`{' '.join(r.step.cmd)}`", "",
                  f"exit code {_code(r)}, {r.seconds:.1f} s (timeout {r.step.timeout:.0f} s)",
                  "", "```", r.tail, "```"]
    return "\n".join(lines) + "\n"


def _code(result: Result) -> str:
    return "timeout" if result.returncode is None else str(result.returncode)


def main(argv: list[str] | None = None) -> int:
    """Detect, run every step, write the report; 2 without a device, 1 if a step failed."""
    args = parse_args(argv)
    device = detect_device(args.device)
    if device is None:
        wanted = args.device if args.device != "auto" else "CUDA GPU or Trainium (neuron) device"
        print(f"device_check: no {wanted} here; nothing to check", file=sys.stderr)
        return 2
    out = args.out or Path(f"device-check-{device}.md")
    deadline = time.monotonic() + args.budget
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        listing = run_step(Step("fusionlab list", fusionlab("list"), 30), deadline, 10**6)
        ops = registered_ops(listing.tail)
        listing = Result(listing.step, listing.returncode, listing.seconds,
                         "\n".join(listing.tail.splitlines()[-args.tail:]))
        results = [listing]
        for step in plan(device, ops, f"sqlite:///{Path(tmp) / 'sweep.db'}"):
            results.append(run_step(step, deadline, args.tail))
            print(f"{step.name}: {_code(results[-1])} in {results[-1].seconds:.1f} s", flush=True)
    out.write_text(render(device, versions(device), results))
    print(f"report: {out}")
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
