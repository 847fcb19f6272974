"""A winners file whose winner writes into its inputs: the export keeps the variant's name apart
from its display label, and the Dispatcher dispatches it only with allow_inplace (else the
row's best out-of-place variant), with values checked against a float64 computation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import PLUGINS, run_cli
from helpers import sqlite_url

from fusionlab import Dispatcher
from fusionlab.errors import UserError
from fusionlab.plan import load_user_variants

SLOW = str(PLUGINS / "slow_out_of_place.py")


@pytest.fixture(scope="module")
def winners(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("winners")
    path = folder / "winners.json"
    result = run_cli("sweep", "add_rmsnorm", "--quick", "--shapes", "4x256", "--dtypes",
                     "float32", "--variants", "builtin-inplace,slow-naive", "--plugin", SLOW,
                     "--threads", "1", "--storage", sqlite_url(folder / "r.db"),
                     "--export", str(path), cwd=folder)
    assert result.returncode == 0, result.stderr[-2000:]
    load_user_variants([SLOW])
    return path


def _expected(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    total = x.double() + residual.double()
    y = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y, total


def test_the_export_names_the_variant_apart_from_its_label(winners: Path) -> None:
    (row,) = json.loads(winners.read_text())["rows"]
    assert row["label"] == "builtin-inplace (in place)" and row["variant"] == "builtin-inplace"
    assert row["inplace"] is True and row["out_of_place"]["variant"] == "slow-naive"


@pytest.mark.parametrize("allow_inplace", [False, True])
def test_an_inplace_winner_dispatches_and_respects_allow_inplace(winners: Path,
                                                                 allow_inplace: bool) -> None:
    dispatch = Dispatcher("add_rmsnorm", winners=str(winners), allow_inplace=allow_inplace)
    generator = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(4, 256, generator=generator) for _ in range(2))
    weight = 0.5 + torch.rand(256, generator=generator)
    y_expected, sum_expected = _expected(x, residual, weight, 1e-6)
    x_before = x.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the cell was measured with one thread
    try:
        choice = dispatch.choose((4, 256), torch.float32, "cpu")
        y, residual_out = dispatch(x, residual, weight, 1e-6)
    finally:
        torch.set_num_threads(before)
    assert choice.match == "exact"
    assert choice.variant == ("builtin-inplace" if allow_inplace else "slow-naive")
    torch.testing.assert_close(y.double(), y_expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual_out.double(), sum_expected, rtol=1e-6, atol=1e-6)
    if allow_inplace:
        assert y.data_ptr() == x.data_ptr()  # the winner wrote into its input
    else:
        assert torch.equal(x, x_before)  # the caller's input is left alone


def test_a_winners_file_from_a_newer_fusionlab_is_refused(winners: Path, tmp_path: Path) -> None:
    data = json.loads(winners.read_text())
    data["meta"]["version"] = 99
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"newer fusionlab \(schema 99\); upgrade fusionlab$"):
        Dispatcher("add_rmsnorm", winners=str(newer))
