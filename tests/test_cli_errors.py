"""Bad input: one line that says what to fix, exit code 2, no traceback, nothing written."""

from pathlib import Path

import pytest
from conftest import PLUGINS, run_cli

from fusionlab.cli import main

NOT_A_DIR = "/etc/hostname/traces"


def _bad_plugin(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


# Bad options of `fusionlab sweep rmsnorm`, each with its value.
BAD_SWEEP_OPTIONS = [
    "--shapes 0x4096", "--shapes 4x", "--shapes abc", "--variants naive,fastest-ever",
    "--dtypes float8", "--device tpu", "--device cuda", "--variants triton",
    "--storage sqlite:////no/such/folder/x.db",
    "--storage postgresql://user@127.0.0.1:1/fusionlab", "--storage mysql://nope",
    "--export table.xlsx", "--export /no/such/folder/t.md", "--plugin does_not_exist.py",
    "--trials many", "--trials 0", "--trials -3", "--timeout 0", "--calls 0", "--pass sideways",
    "--shapes 4x4096,,8x4096", "--dtypes float32,", "--variants naive,,builtin",
    "--shapes 100000000x100000",
]


@pytest.mark.parametrize(
    "argv",
    [
        *(["sweep", "rmsnorm", *option.split()] for option in BAD_SWEEP_OPTIONS),
        ["sweep", "layernorm-nope"],
        ["sweep", "add_rmsnorm", "--pass", "backward", "--variants", "naive,builtin-inplace"],
        ["sweep", "l2norm", "--plugin", str(PLUGINS / "l2norm_op.py"), "--pass", "backward"],
        ["sweep", "layernorm", "--shapes", "100000000x100000"],
        ["compare", "add_rmsnorm", "--shape", "100000000x100000"],
        ["export", "rmsnorm", "--format", "docx"],
        ["compare", "rmsnorm", "--shape", "2x", "--variants", "naive"],
        ["compare", "rmsnorm", "--shape", "2x8", "--variants", "nope"],
        ["compare", "rmsnorm", "--shape", "2x8", "--variants", "naive", "--trace-dir", NOT_A_DIR],
        ["profile", "rmsnorm", "--shape", "2x8", "--variant", "nope"],
        ["profile", "rmsnorm", "--shape", "2x8", "--variant", "cpp", "--param", "bogus=1"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusionlab: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert list(tmp_path.iterdir()) == []  # no storage, export or trace file was created


def test_export_without_results_says_run_sweep_first(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["export", "rmsnorm"]) == 2
    assert "run `fusionlab sweep` first" in capsys.readouterr().err
    assert not (tmp_path / "fusionlab.db").exists()


@pytest.mark.parametrize(
    ("name", "body", "message"),
    [
        ("raises.py", "raise ImportError('missing dependency xyz')\n", "missing dependency xyz"),
        ("syntax.py", "def broken(:\n", "SyntaxError"),
        ("invalid.py",
         "from fusionlab import register_variant\n"
         "register_variant('rmsnorm', 'x', devices=('tpu',))(lambda d: None)\n",
         "devices must be among"),
    ],
)
def test_broken_plugins_in_a_real_process(
    tmp_path: Path, name: str, body: str, message: str
) -> None:
    plugin = _bad_plugin(tmp_path, name, body)
    result = run_cli("sweep", "rmsnorm", "--plugin", plugin, cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "fusionlab.db").exists()
