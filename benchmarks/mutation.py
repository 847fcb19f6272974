"""Mutation testing as a habit (not a CI gate): mutmut changes the code under test one small
edit at a time and runs that code's own tests; a mutant the tests do not notice "survives" and
points at behaviour nothing checks.

Each target is a module and its own test files. The run happens in a scratch copy of the
checkout (mutmut writes a `mutants/` folder and its config there, never here), without the
PYTHONPATH of a worktree, so the mutated copy is what the tests import. Prints the score and the
surviving mutants of each target, with `mutmut show NAME` (run in the scratch folder) for a diff.

    python benchmarks/mutation.py verdict claims       # the named targets (all when none)
    python benchmarks/mutation.py --list               # the targets and their tests
    python benchmarks/mutation.py trial --keep         # keep the scratch folder, then ...
    python benchmarks/mutation.py trial --again DIR    # ... re-run its survivors after new tests

Needs `pip install mutmut` (the `mutation` extra). mutmut runs, for each mutant, only the tests
that called the mutated function (its stats pass, in this process: a function only worker
processes call goes untested). Times on this 2-core machine: verdict about 6 minutes, trial
about 24, claims about 60 (real PostgreSQL and journal storages per mutant); --again re-runs
only the survivors. Run them on an otherwise quiet machine, one at a time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("fusionlab", "kernels", "search", "tests", ".ci", "setup.py", "pyproject.toml")

# target -> (the module mutated, its own test files)
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "verdict": ("fusionlab/verdict.py", ("tests/test_verdict.py",)),
    "claims": ("search/claims.py", ("tests/test_claims.py",)),
    "correctness": (
        "fusionlab/measure/correctness.py",
        ("tests/test_value_check.py", "tests/test_gate_rules.py", "tests/test_trial.py"),
    ),
    "trial": ("fusionlab/measure/trial.py", ("tests/test_gate_rules.py", "tests/test_trial.py")),
    "timing": ("fusionlab/measure/timing.py", ("tests/test_trial.py", "tests/test_gate_rules.py")),
    "limits": ("fusionlab/measure/limits.py", ("tests/test_limits.py",)),
}


def _config(module: str, tests: tuple[str, ...]) -> str:
    others = [name for name in COPIED if name not in ("fusionlab", "kernels", "search",
                                                       "pyproject.toml")]
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["fusionlab/"]\n'
        f'only_mutate = ["{_installed(module)}"]\n'
        f"pytest_add_cli_args_test_selection = {list(tests)!r}\n"
        f"also_copy = {others!r}\n"
        # mutmut's advice for test setups that are not fork-safe (torch among them): fork
        # each mutant from a server that only imported the tests
        'process_isolation = "forkserver"\n'
        "mutate_only_covered_lines = true\n"
        "timeout_multiplier = 5.0\n"
    ).replace("'", '"')


def _installed(module: str) -> str:
    """Where `module` sits as installed: kernels/ and search/ inside the fusionlab package."""
    return module if module.startswith("fusionlab/") else f"fusionlab/{module}"


def copy_checkout(scratch: Path, items: tuple[str, ...] = COPIED) -> None:
    """The checkout's code, tests and packaging files (or only `items` of them), copied into
    `scratch` (built objects and caches left out)."""
    for item in items:
        source = ROOT / item
        if source.is_dir():
            shutil.copytree(source, scratch / item,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(source, scratch / item)


@dataclass
class Outcome:
    """One target's mutants by mutmut's status, and the survivors by name."""

    counts: Counter[str]
    survivors: list[str]
    failure: str = ""

    def line(self, name: str) -> str:
        if self.failure:
            return f"{name}: mutmut did not run the mutants: {self.failure}"
        tested = self.counts["killed"] + self.counts["timeout"] + self.counts["survived"]
        caught = tested - self.counts["survived"]
        score = 100 * caught / tested if tested else 0.0
        others = ", ".join(f"{count} {status}" for status, count in sorted(self.counts.items())
                           if status not in ("killed", "timeout", "survived"))
        return (f"{name}: {caught}/{tested} mutants killed ({score:.0f}%; "
                f"{self.counts['timeout']} of them by timeout), {self.counts['survived']} "
                f"survived" + (f"; not tested: {others}" if others else ""))


def _scratch_for(name: str) -> Path:
    """A fresh scratch copy of the checkout, laid out and configured for target `name`."""
    module, tests = TARGETS[name]
    scratch = Path(tempfile.mkdtemp(prefix=f"fusionlab-mutation-{name}-"))
    copy_checkout(scratch)
    for portion in ("kernels", "search"):
        # As the wheel lays them out, so a mutant's module name (fusionlab.search.claims) is the
        # name its file has under the mutated source path.
        shutil.move(scratch / portion, scratch / "fusionlab" / portion)
    with open(scratch / "pyproject.toml", "a") as config:
        config.write(_config(module, tests))
    return scratch


def _statuses(scratch: Path, env: dict[str, str]) -> list[tuple[str, str]]:
    listed = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                            cwd=scratch, env=env, capture_output=True, text=True,
                            check=False).stdout
    return re.findall(r"^\s*(\S+): (.+?)\s*$", listed, re.M)


def run_target(name: str, children: int, keep: bool, again: Path | None) -> Outcome:
    """Mutate one target in a scratch copy of the checkout; with `again`, a kept scratch folder
    of an earlier run gets this checkout's tests and re-runs only the mutants that survived."""
    module, tests = TARGETS[name]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    chosen: list[str] = []
    if again is None:
        scratch = _scratch_for(name)
    else:
        scratch, keep = again, True
        if (scratch / _installed(module)).read_bytes() != (ROOT / module).read_bytes():
            return Outcome(Counter(), [], f"{module} changed since the run in {scratch}: "
                                          "run the target whole again")
        for item in ("tests", ".ci"):
            shutil.rmtree(scratch / item, ignore_errors=True)
        copy_checkout(scratch, ("tests", ".ci"))
        chosen = [mutant for mutant, status in _statuses(scratch, env) if status == "survived"]
        # Which tests call which function, collected anew: changed tests may call more.
        (scratch / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    print(f"== {name}: {module} against {', '.join(tests)} (in {scratch})"
          + (f", the {len(chosen)} survivors again" if again else ""), flush=True)
    run = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *chosen],
        cwd=scratch, env=env, capture_output=True, text=True, check=False,
    )
    statuses = _statuses(scratch, env)
    counts = Counter(status for _, status in statuses)
    survivors = [mutant for mutant, status in statuses if status == "survived"]
    failure = ""
    if run.returncode != 0 or not counts["killed"] + counts["survived"]:
        said = [line for line in (run.stdout + run.stderr).replace("\r", "\n").splitlines()
                if line.strip() and not _spinner(line)]
        failure = f"exit code {run.returncode}: {said[-1].strip() if said else 'nothing said'}"
    if not keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return Outcome(counts, survivors, failure)


def _spinner(line: str) -> bool:
    """Whether `line` is a frame of mutmut's progress spinner (braille glyphs)."""
    return any("\u2800" <= char <= "\u28ff" for char in line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"some of: {', '.join(TARGETS)}")
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch folder (for `mutmut show NAME` there)")
    parser.add_argument("--list", action="store_true", help="list the targets and stop")
    parser.add_argument("--again", type=Path, metavar="SCRATCH",
                        help="a folder kept by --keep: re-run its survivors against this "
                             "checkout's tests (one target, its module unchanged)")
    args = parser.parse_args()
    unknown = [name for name in args.targets if name not in TARGETS]
    if unknown:
        print(f"unknown target(s) {unknown}: choose from {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    if args.again and (len(args.targets) != 1 or not (args.again / "mutants").is_dir()):
        print("--again takes one target and a folder an earlier --keep run left",
              file=sys.stderr)
        return 2
    if args.list:
        for name, (module, tests) in TARGETS.items():
            print(f"{name:12s} {module}  <-  {' '.join(tests)}")
        return 0
    failed = False
    for name in args.targets or list(TARGETS):
        started = time.monotonic()
        outcome = run_target(name, args.children, args.keep, args.again)
        print(f"{outcome.line(name)} [{(time.monotonic() - started) / 60:.1f} min]", flush=True)
        for mutant in outcome.survivors:
            print(f"  survived: {mutant}")
        failed |= bool(outcome.failure)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
