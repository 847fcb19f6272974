"""Results keyed by the whole toolchain: an edited kernel source starts new cells, and export and
the Dispatcher say when what they read was measured with another toolchain."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import optuna
import torch
from helpers import QUICK_TIMING as FAST
from helpers import sqlite_url

from fusionlab import Dispatcher, sweep
from fusionlab.search import results_store as store
from fusionlab.search.storage import open_storage

PLUGIN = Path(__file__).parent / "plugins" / "l2norm_op.py"

_STUDY_NAMES = """
import sys
from fusionlab.plan import make_plan
from fusionlab.search.results_store import study_name
plan = make_plan("l2norm", "4x64", "float32", "cpu", plugins=[sys.argv[1]])
print(study_name(plan.cells()[0]))
"""


def _study_name(plugin: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _STUDY_NAMES, str(plugin)],
        capture_output=True, text=True, check=True, timeout=120,
    )
    return result.stdout.strip()


def test_an_edited_kernel_source_starts_new_cells(tmp_path: Path) -> None:
    plugin = tmp_path / "l2norm_op.py"
    shutil.copy(PLUGIN, plugin)
    before = _study_name(plugin)
    assert _study_name(plugin) == before  # stable while nothing changes
    plugin.write_text(plugin.read_text() + "\n# a kernel edit\n")
    assert _study_name(plugin) != before


def _measure(tmp_path: Path) -> str:
    url = sqlite_url(tmp_path / "old.db")
    sweep("rmsnorm", "4x64", "float32", device="cpu", storage=url,
          variants=["naive", "builtin"], timing=FAST)
    return url


def _age_stored_toolchain(url: str) -> None:
    """Rewrite the stored cell as if it had been measured with an older torch."""
    storage = open_storage(url, must_exist=True)
    for cell, _ in store.planned_cells(storage):
        study = optuna.load_study(study_name=store.study_name(cell), storage=storage)
        data = dict(study.user_attrs[store.CELL_ATTR])
        data["toolchain"] = {**data["toolchain"], "torch": "2.0.0"}
        study.set_user_attr(store.CELL_ATTR, data)


def test_export_notes_another_toolchain(tmp_path: Path) -> None:
    url = _measure(tmp_path)
    command = [sys.executable, "-m", "fusionlab.cli", "export", "rmsnorm", "--storage", url]
    fresh = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert "another toolchain" not in fresh.stderr
    _age_stored_toolchain(url)
    aged = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert f"torch 2.0.0 -> {torch.__version__}" in aged.stderr
    assert "fusionlab sweep rmsnorm" in aged.stderr


def test_dispatcher_warns_for_a_winners_file_of_another_toolchain(tmp_path: Path) -> None:
    url = _measure(tmp_path)
    winners = tmp_path / "winners.json"
    subprocess.run(
        [sys.executable, "-m", "fusionlab.cli", "export", "rmsnorm", "--storage", url,
         "--format", "json", "-o", str(winners)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    data = json.loads(winners.read_text())
    x = torch.randn(4, 64)
    weight = 1 + 0.5 * torch.randn(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the installed toolchain: no warning
        Dispatcher("rmsnorm", winners=str(winners))(x, weight, 1e-6)
    for row in data["rows"]:
        row["toolchain"]["torch"] = "2.0.0"
    winners.write_text(json.dumps(data))
    dispatch = Dispatcher("rmsnorm", winners=str(winners))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dispatch(x, weight, 1e-6)
        dispatch(x, weight, 1e-6)
    # Only the Dispatcher's own words: a connection another test left to the garbage collector
    # may say ResourceWarning meanwhile.
    messages = [str(w.message) for w in caught if str(w.message).startswith("fusionlab:")]
    assert len(messages) == 1, messages  # once per difference, not per call
    assert f"torch 2.0.0 -> {torch.__version__}" in messages[0]
    assert "fusionlab sweep rmsnorm" in messages[0]
    torch.testing.assert_close(out, torch.rms_norm(x, (64,), weight, 1e-6), atol=1e-5, rtol=1e-5)


def _layernorm_hash(kernels: Path) -> str:
    from fusionlab.toolchain import files_hash, op_folder_sources

    return files_hash(op_folder_sources(kernels / "layernorm", [kernels]))


def test_a_shared_header_or_helper_starts_new_cells_and_a_test_helper_does_not(
        tmp_path: Path) -> None:
    """In a copy of the kernel tree: layernorm's identity follows rmsnorm's C++ header and
    Triton helpers it uses, and not the NKI hardware model that only tests replay on."""
    from fusionlab.registry import get_op
    from fusionlab.toolchain import _source_files

    real = Path(__file__).resolve().parents[1] / "kernels"
    assert real / "rmsnorm" / "csrc" / "cpu_norm_common.h" in _source_files(get_op("layernorm"))
    kernels = tmp_path / "kernels"
    shutil.copytree(real, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    before = _layernorm_hash(kernels)
    replay = kernels / "nki_replay.py"
    replay.write_text(replay.read_text() + "\n# the hardware model edited\n")
    assert _layernorm_hash(kernels) == before
    for shared in ("rmsnorm/csrc/cpu_norm_common.h", "common/triton_tiles.py"):
        file = kernels / shared
        file.write_text(file.read_text() + "\n// edited\n" if file.suffix == ".h"
                        else file.read_text() + "\n# edited\n")
        after = _layernorm_hash(kernels)
        assert after != before, shared
        before = after
