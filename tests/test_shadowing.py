"""A Python started in the clone's root (`python -c`, `python -m pytest`, a notebook) sees the
real packages named `kernels` and `search`, not fusionlab's folders: those are namespace
portions, and a regular package found later on sys.path wins over them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("kernels", reason="Hugging Face `kernels` is a test dependency")
pytest.importorskip("transformers", reason="transformers is a test dependency")


def _python_in_root(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env_path = [str(extra_path)] if extra_path else []
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
        timeout=300, check=False,
        env={**__import__("os").environ, "PYTHONPATH": ":".join(env_path)},
    )


def test_kernels_is_hugging_faces_and_a_llama_builds_beside_fusionlab(tmp_path: Path) -> None:
    result = _python_in_root("""
        import kernels
        assert hasattr(kernels, "kernelize"), kernels.__file__
        print("kernels from", kernels.__file__)
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=4, vocab_size=97)
        LlamaForCausalLM(config)
        import fusionlab
        from fusionlab.kernels.rmsnorm import spec
        from fusionlab.search import runner
        cells = fusionlab.sweep("rmsnorm", "2x64", "float32", device="cpu",
                                storage="sqlite:///%s", variants="naive,builtin", quick=True)
        print("swept", sorted({r.variant for cell in cells for r in cell.ranked()}))
    """ % (tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr[-3000:]
    found = result.stdout.split("kernels from ")[1].splitlines()[0]
    assert not found.startswith(str(ROOT / "kernels")), found  # a venv may sit inside the clone
    assert "swept ['builtin', 'naive']" in result.stdout


def test_a_regular_search_package_later_on_the_path_wins(tmp_path: Path) -> None:
    other = tmp_path / "site" / "search"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'the real search package'\n")
    result = _python_in_root("""
        import search
        print(search.WHO)
        import fusionlab.search.claims
    """, extra_path=tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "the real search package"


def test_top_level_folders_are_not_regular_packages() -> None:
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "search" / "__init__.py").exists()
