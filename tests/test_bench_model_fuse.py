"""`fusionlab bench-model --fuse`: the six model-level configurations side by side, through the
real CLI on a tiny random Llama with real quick sweeps of its keys (no mocks). A one-token prompt
makes the prefill and decode keys the same, so one key per op is swept. The compiled
configurations use `--compile-backend eager` (dynamo's graphs run as traced) to keep the test
short; inductor, the default, is what benchmarks/model_fusion.py measures."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers import sqlite_url

from fusionlab import capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.cli import main
from fusionlab.model.capture import Capture
from fusionlab.model.fusion_bench import CONFIGS, FusionResult, FusionRow
from fusionlab.model.fusion_table import render_fusion
from fusionlab.model.sweep_saving import predicted_saving, sweep_times

TOKENS = 1
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
CONFIG = ",".join(f"{key}={value}" for key, value in LLAMA.items())
GAIN = r"\d+\.\d{3}x \[\d+\.\d{3}, \d+\.\d{3}\]"
# A model dynamo cannot trace: its head calls a custom op with no fake kernel.
UNTRACEABLE = f'''
import torch
from fusionlab import tiny_model


def _no_fake():
    try:
        return torch.ops.fusionlab_test.no_fake.default
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("fusionlab_test::no_fake", mutates_args=())
    def no_fake(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    return torch.ops.fusionlab_test.no_fake.default


class Head(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(_no_fake()(x))


def make():
    model = tiny_model("llama-tiny", overrides={LLAMA!r})
    model.lm_head = Head(model.lm_head)
    return model
'''


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A capture of the tiny Llama and quick sweeps of rmsnorm and add_rmsnorm at its key."""
    folder = tmp_path_factory.mktemp("bench-fuse")
    model = tiny_model("llama-tiny", overrides=LLAMA)
    capture(model, causal_lm_steps(model, TOKENS), repeats=3).save(folder / "cap.json")
    url = sqlite_url(folder / "results.db")
    for op in ("rmsnorm", "add_rmsnorm"):
        sweep(op, "1x1x64", "float32", storage=url, quick=True, variants="naive,builtin")
    return folder, url


def _bench(folder: Path, url: str, *extra: str) -> list[str]:
    return ["bench-model", "--capture", str(folder / "cap.json"), "--tokens", str(TOKENS),
            "--storage", url, "--runs", "3", *extra]


def _rows(out: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with `header` (columns split on 2+
    spaces)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start:end]]


def test_six_configurations_per_step_with_gains_logits_and_a_named_best(swept, capsys) -> None:
    folder, url = swept
    code = main(_bench(folder, url, "--model", "llama-tiny", "--config", CONFIG, "--fuse",
                       "--compile-backend", "eager"))
    out = capsys.readouterr().out
    assert code == 0
    fusion = out[out.index("step     configuration"):]
    assert max(len(line) for line in fusion.splitlines()) <= 100

    timing = _rows(fusion, "step     configuration       median ms")
    assert [(r[0], r[1]) for r in timing] == [(s, c) for s in ("prefill", "decode")
                                             for c in CONFIGS]
    for _step, config, median, predicted, gain in timing:
        assert float(median) > 0
        if config == "eager":
            assert gain == "1 (reference)"
        else:
            assert re.fullmatch(GAIN, gain.removesuffix(" [disturbed]")), gain
        if config in ("patched", "patched+fused"):  # from the sweep results
            assert re.fullmatch(r"\d+\.\d{3}x( \[disturbed\])?", predicted), predicted
        else:
            assert predicted == "-"
    notes = " ".join(out.split())  # the notes are wrapped at 100 columns
    assert "predicted '-' for compile, compile+patched, compile+fused pass: no prediction" in notes

    accuracy = _rows(fusion, "step     configuration       max |dlogits|")
    assert len(accuracy) == 12
    for _step, config, diff, agree, compile_s in accuracy:
        assert float(diff) < 1e-3 and agree == "100.0%"
        assert (compile_s == "-") == (not config.startswith("compile"))
    # one fused layer eagerly; the pass fuses the post-attention norm's add and the final norm's
    assert "patched+fused 1, compile+fused pass 2" in notes
    for step in ("prefill", "decode"):
        best = re.search(rf"^{step}: best (.+?) \(\d+\.\d{{3}} ms\); runner-up (.+?) is ({GAIN})",
                         fusion, re.MULTILINE)
        assert best is not None and {best[1], best[2]} <= set(CONFIGS) and best[1] != best[2]


def test_a_model_dynamo_cannot_trace_keeps_its_eager_rows(swept, tmp_path, capsys) -> None:
    folder, url = swept
    (tmp_path / "untraceable.py").write_text(UNTRACEABLE)
    code = main(_bench(folder, url, "--model", f"{tmp_path / 'untraceable.py'}:make",
                       "--fuse", "--compile-backend", "eager"))
    captured = capsys.readouterr()
    assert code == 0
    said = [line for line in captured.err.splitlines() if "not measured" in line]
    assert [line.split(":")[0] for line in said] == ["compile", "compile+patched",
                                                     "compile+fused pass"]
    assert all("torch.compile could not run the model" in line for line in said)
    timing = _rows(captured.out, "step     configuration       median ms")
    for _step, config, median, _, gain in timing:
        if config.startswith("compile"):
            assert (median, gain) == ("-", "not measured (see below)")
        else:
            assert float(median) > 0
    assert re.search(r"prefill: best (eager|patched|patched\+fused) ", captured.out)


@pytest.mark.parametrize("extra, message", [
    (["--compile-backend", "eager"], "fusionlab: --compile-backend chooses the compiler of the "
     "six --fuse configurations: give it with --fuse and without --train, or leave it out"),
    (["--fuse", "--compile-backend", "tvm"], "fusionlab: argument --compile-backend: invalid "
     "choice: 'tvm' (choose from 'inductor', 'eager') (see fusionlab bench-model --help)"),
])
def test_bad_fuse_options_say_what_to_fix_in_one_line(tmp_path, capsys, extra, message) -> None:
    model = tiny_model("llama-tiny", overrides=LLAMA)
    capture(model, causal_lm_steps(model, TOKENS), repeats=1).save(tmp_path / "cap.json")
    url = sqlite_url(tmp_path / "results.db")
    try:
        code = main(_bench(tmp_path, url, "--model", "llama-tiny", *extra))
    except SystemExit as exit_:  # argparse refuses unknown values before the command runs
        code = exit_.code
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]
    assert not (tmp_path / "results.db").exists()


def test_a_disturbed_sweep_figure_marks_the_prediction(swept) -> None:
    folder, url = swept
    model = tiny_model("llama-tiny", overrides=LLAMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = patch(model, Capture.load(folder / "cap.json"), storage=url, fuse=True)
    with torch.no_grad():
        for step in causal_lm_steps(model, TOKENS):
            step.run()  # the fused layer resolves its key on first use
    times = sweep_times(url, {"rmsnorm", "add_rmsnorm"}, torch.get_num_threads(), "cpu")
    honest = predicted_saving(handle, "prefill", times)
    # 1 layer: input_layernorm and the final norm as rmsnorm, the fused one as add_rmsnorm
    chosen = {(r.op, r.key): r.variant for r in handle.all_rows()}
    want = sum((times[op, key]["naive"] - times[op, key][chosen[op, key]]) * calls for op, calls
               in (("rmsnorm", 2), ("add_rmsnorm", 1)) for key in ["1x1x64 float32"])
    assert honest.saving_ms == pytest.approx(want) and honest.problem == ""

    times["add_rmsnorm", "1x1x64 float32"]["naive"] *= 1e4  # as a sweep disturbed by load
    disturbed = predicted_saving(handle, "prefill", times)
    assert "is beyond 100x" in disturbed.problem and "add_rmsnorm 1x1x64" in disturbed.problem
    row = FusionRow("prefill", "patched+fused", (1.0, 1.1), 1.0, 0.9, 1.1, 2.0,
                    predicted_problem=disturbed.problem)
    result = FusionResult([FusionRow("prefill", "eager", (1.0, 1.1)), row], 2, 1, "eager", {},
                          {}, [])
    shown = render_fusion(result)
    assert "2.000x [disturbed]" in shown
    assert f"disturbed: prefill patched+fused: {disturbed.problem[:40]}" in " ".join(shown.split())
