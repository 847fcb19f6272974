"""Mutation testing as a habit (not a CI gate): mutmut changes the code under test one small
edit at a time and runs that code's own tests; a mutant the tests do not notice "survives" and
points at behaviour nothing checks.

Each target is a module and its own test files. The run happens in a scratch copy of the
checkout (mutmut writes a `mutants/` folder and its config there, never here), without the
PYTHONPATH of a worktree, so the mutated copy is what the tests import. Prints the score and the
surviving mutants of each target, with `mutmut show NAME` (run in the scratch folder) for a diff.

    python benchmarks/mutation.py                      # every target below (about 20+ minutes)
    python benchmarks/mutation.py verdict claims       # the named targets only
    python benchmarks/mutation.py --list               # the targets and their tests

Needs `pip install mutmut` (the `mutation` extra). Slow targets (the gate, the claims) run real
trials and real worker processes: run them on a quiet machine, one at a time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("fusionlab", "kernels", "search", "tests", "setup.py", "pyproject.toml")

# target -> (the module mutated, its own test files)
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "verdict": ("fusionlab/report/verdict.py", ("tests/test_verdict.py",)),
    "claims": ("search/claims.py", ("tests/test_claims.py",)),
    "correctness": (
        "fusionlab/measure/correctness.py",
        ("tests/test_gate_rules.py", "tests/test_trial.py"),
    ),
    "trial": ("fusionlab/measure/trial.py", ("tests/test_gate_rules.py", "tests/test_trial.py")),
    "timing": ("fusionlab/measure/timing.py", ("tests/test_trial.py", "tests/test_gate_rules.py")),
    "limits": ("fusionlab/measure/limits.py", ("tests/test_limits.py",)),
}


def _config(module: str, tests: tuple[str, ...]) -> str:
    package = module.split("/")[0]
    others = [name for name in COPIED if name not in (package, "pyproject.toml")]
    return (
        "\n[tool.mutmut]\n"
        f'source_paths = ["{package}/"]\n'
        f'only_mutate = ["{module}"]\n'
        f"pytest_add_cli_args_test_selection = {list(tests)!r}\n"
        f"also_copy = {others!r}\n"
    ).replace("'", '"')


def copy_checkout(scratch: Path) -> None:
    """The checkout's code, tests and packaging files, copied into `scratch` (built objects and
    caches left out)."""
    for item in COPIED:
        source = ROOT / item
        if source.is_dir():
            shutil.copytree(source, scratch / item,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(source, scratch / item)


def run_target(name: str, children: int, keep: bool) -> tuple[int, int, list[str]]:
    """Mutate one target in a scratch copy; returns (mutants, killed, survivors)."""
    module, tests = TARGETS[name]
    scratch = Path(tempfile.mkdtemp(prefix=f"fusionlab-mutation-{name}-"))
    copy_checkout(scratch)
    with open(scratch / "pyproject.toml", "a") as config:
        config.write(_config(module, tests))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    mutmut = [sys.executable, "-m", "mutmut"]
    print(f"== {name}: {module} against {', '.join(tests)} (in {scratch})", flush=True)
    subprocess.run([*mutmut, "run", "--max-children", str(children)], cwd=scratch, env=env,
                   stdout=subprocess.DEVNULL, check=False)
    listed = subprocess.run([*mutmut, "results", "--all", "true"], cwd=scratch, env=env,
                            capture_output=True, text=True, check=False).stdout
    statuses = re.findall(r"^\s*(\S+): (\S+)", listed, re.M)
    survivors = [mutant for mutant, status in statuses if status == "survived"]
    killed = sum(status == "killed" for _, status in statuses)
    if not keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return len(statuses), killed, survivors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"some of: {', '.join(TARGETS)}")
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch folder (for `mutmut show NAME` there)")
    parser.add_argument("--list", action="store_true", help="list the targets and stop")
    args = parser.parse_args()
    unknown = [name for name in args.targets if name not in TARGETS]
    if unknown:
        print(f"unknown target(s) {unknown}: choose from {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    if args.list:
        for name, (module, tests) in TARGETS.items():
            print(f"{name:12s} {module}  <-  {' '.join(tests)}")
        return 0
    for name in args.targets or list(TARGETS):
        total, killed, survivors = run_target(name, args.children, args.keep)
        score = 100 * killed / total if total else 0.0
        print(f"{name}: {killed}/{total} mutants killed ({score:.0f}%), "
              f"{len(survivors)} survived")
        for mutant in survivors:
            print(f"  survived: {mutant}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
