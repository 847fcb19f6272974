"""README's "Add your own op", followed as a user would: an op defined in a plugin file with its
spec and two variants is listed, swept, exported and dispatched, with the real command."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import PLUGINS, run_cli
from helpers import sqlite_url

from fusionlab import Dispatcher
from fusionlab.registry import get_op, load_plugin

PLUGIN = str(PLUGINS / "l2norm_op.py")


def test_an_op_from_a_plugin_is_swept_exported_and_dispatched(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "own.db")
    listed = run_cli("list", "--plugin", PLUGIN, cwd=tmp_path)
    assert listed.returncode == 0 and "l2norm" in listed.stdout and "normalize" in listed.stdout
    swept = run_cli("sweep", "l2norm", "--plugin", PLUGIN, "--quick", "--storage", url,
                    "--wide", cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr
    assert "vs naive" in swept.stdout and "vs normalize" in swept.stdout
    exported = run_cli("export", "l2norm", "--plugin", PLUGIN, "--storage", url, "--format",
                       "json", "-o", "winners.json", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    (row,) = json.loads((tmp_path / "winners.json").read_text())["rows"]
    assert row["shape"] == "8x512" and row["variant"] in {"naive", "normalize"}
    assert row["pct_fresh_copy"] > 0 and row["ratio"] > 0

    load_plugin(PLUGIN)
    spec = get_op("l2norm")
    inputs = spec.make_inputs((8, 512), torch.float32, torch.device("cpu"), 3)
    for dispatch in (Dispatcher("l2norm", storage=url),
                     Dispatcher("l2norm", winners=str(tmp_path / "winners.json"))):
        assert dispatch.choose((8, 512), torch.float32, "cpu").variant == row["variant"]
        assert dispatch.choose((16, 512), torch.float32, "cpu").match == "nearest"
        torch.testing.assert_close(dispatch(*inputs).double(), spec.reference(inputs)[0],
                                   atol=1e-4, rtol=1e-4)
