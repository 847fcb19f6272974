"""Every valid Triton tunable point at hidden 4096 and 8192, compiled for sm_90 here (no GPU).

Both dtypes are compiled: fp32 is not redundant, it loads 4-wide vectors instead of 8 and needs
~25% more registers per held value, which is what bounds the tile (see rmsnorm/triton_kernel.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from fusionlab.kernels.triton_hopper import HIDDEN_SIZES, OPS, ROWS, markdown, occupancy

DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("hopper")
    # A subprocess: kernels decorated under TRITON_INTERPRET (set for this process) cannot compile.
    # An empty cache, so every point is really lowered and assembled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    cmd = [sys.executable, "-m", "fusionlab.kernels.triton_hopper", "--dtypes", ",".join(DTYPES),
           "--workers", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout)
    report = markdown(results)
    (tmp / "hopper_report.json").write_text(json.dumps(results, indent=1))
    (tmp / "hopper_report.md").write_text(report + "\n")
    print(f"\n{report}\nreport: {tmp / 'hopper_report.md'}")
    return results


def test_every_valid_point_is_compiled(compiled):
    from fusionlab.kernels.triton_hopper import valid_points

    for op in OPS:
        for hidden in HIDDEN_SIZES:
            expected = valid_points(op, hidden)
            assert expected, (op, hidden)
            for dtype in DTYPES:
                got = [
                    {k: r[k] for k in expected[0]}
                    for r in compiled
                    if (r["op"], r["hidden"], r["dtype"]) == (op, hidden, dtype)
                ]
                assert got == expected, (op, hidden, dtype)


def test_zero_spills(compiled):
    spilling = [r for r in compiled if r["spill_store_bytes"] or r["spill_load_bytes"]]
    assert not spilling, [(r["op"], r["hidden"], r["dtype"], r["rows_per_program"],
                           r["threads_per_row"], r["registers"]) for r in spilling]


def test_registers_fit_the_block(compiled):
    for r in compiled:
        assert r["registers"] <= min(255, 65536 // (32 * r["num_warps"])), r
        assert r["warps_per_sm"] >= r["num_warps"], r  # at least one block is resident


def test_layout_has_the_requested_threads_per_row(compiled):
    # What makes threads_per_row real: Triton's layout of the x tile, read from the TTGIR.
    for r in compiled:
        layout = r["layout"]
        assert layout["threads_per_row"] == r["threads_per_row"], r
        assert layout["rows_per_program"] == r["rows_per_program"], r
        assert layout["row_threads_split"] == 1, r
        assert layout["vector"] == min(16 // (2 if r["dtype"] == "bfloat16" else 4),
                                       r["block_size"] // r["threads_per_row"]), r


def test_quack_and_liger_points_are_in_the_space(compiled):
    points = {(r["op"], r["hidden"], r["rows_per_program"], r["threads_per_row"]) for r in compiled}
    assert ("rmsnorm", 4096, 2, 64) in points  # Quack _for_hopper_fwd at 4096
    assert ("rmsnorm", 8192, 1, 128) in points  # Quack at 8192
    assert ("rmsnorm", 4096, 1, 256) in points  # Liger calculate_settings: 8 warps
    assert ("rmsnorm", 8192, 1, 512) in points  # Liger: 16 warps


def test_occupancy_arithmetic():
    # 127 registers round up to 4096 per warp: 65536 / (4096 * 4 warps) = 4 blocks = 16 warps.
    assert occupancy(127, 16, 4) == {
        "blocks_per_sm": 4, "warps_per_sm": 16, "occupancy": 0.25, "limited_by": "registers"
    }
    assert occupancy(24, 128, 32)["warps_per_sm"] == 64  # two 32-warp blocks fill the SM
    assert occupancy(16, 100 * 1024, 1)["limited_by"] == "shared"
    assert ROWS >= 64


def test_refuses_to_run_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "fusionlab.kernels.triton_hopper"], env=env,
                          capture_output=True, text=True, check=False, cwd=Path(__file__).parent)
    assert done.returncode == 2
    assert "TRITON_INTERPRET" in done.stderr
