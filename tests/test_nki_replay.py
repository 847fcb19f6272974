"""The three NKI kernels' real bodies replayed in a NumPy MODEL of NKI (kernels/nki_replay.py).

A model of the hardware, not the hardware: it checks calls against the official signatures, DMA
sizes, partition counts, SBUF bytes per partition, HBM traffic and LNC row ownership, and values
against float64 references computed here. AWS's own simulator runs the same cases where `nki` is
installed (test_simulator_...).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fusionlab.kernels import nki_replay
from fusionlab.kernels.add_rmsnorm import nki_kernel as add_rms
from fusionlab.kernels.layernorm import nki_kernel as layer
from fusionlab.kernels.nki_common import FREE_CHUNKS, LNC_SPLITS, PMAX, SBUF_PARTITION_BYTES
from fusionlab.kernels.nki_replay import ModelError
from fusionlab.kernels.rmsnorm import nki_kernel as rms

ROWS = (1, 127, 128, 129, 300)
HIDDENS = (1, 1000, 4096, 5000, 8192)
TUNABLE_POINTS = [dict(free_chunk=c, lnc_split=s) for c, s in itertools.product(FREE_CHUNKS,
                                                                                LNC_SPLITS)]
TOL = {"float32": 1e-4, "bfloat16": 1.6e-2}


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    return nki_replay.DTYPES[dtype].round(a.astype(np.float32))


def _inputs(shape: tuple[int, ...], dtype: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h = shape[-1]
    return {
        "x": _round(rng.standard_normal(shape) * 3 + 0.5, dtype),
        "r": _round(rng.standard_normal(shape), dtype),
        "w": _round(1 + 0.5 * rng.standard_normal(h), dtype),
        "b": _round(0.5 * rng.standard_normal(h), dtype),
    }


def _close(got: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    tol = TOL[dtype]
    assert got.shape == ref.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=tol, atol=tol)


def _rms_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w


def _layer_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x64 - mean) / np.sqrt(var + eps) * w + b


def _check_replay(result: nki_replay.Replay, plan: object, lnc: int, n_inputs: int) -> None:
    """Traffic, SBUF and LNC bookkeeping every replay must satisfy."""
    for reads in result.input_reads[:n_inputs]:
        assert (reads == plan.x_reads).all()  # x (and residual) read exactly as planned
    for writes in result.output_writes:
        assert (writes == 1).all()  # each output element written once across the programs
    assert len(result.sbuf_peak) == lnc
    assert max(result.sbuf_peak) <= plan.sbuf_bytes <= plan.budget


def _run(op: str, shape: tuple[int, ...], dtype: str, lnc: int, generation: str,
         params: dict[str, object], seed: int) -> None:
    d = _inputs(shape, dtype, seed)
    if op == "rmsnorm":
        y, result, plan = rms.replay_rms_norm(d["x"], d["w"], 1e-6, dtype=dtype, lnc=lnc,
                                              generation=generation, **params)
        _close(y, _rms_ref(d["x"], d["w"], 1e-6), dtype)
        _check_replay(result, plan, lnc, 1)
    elif op == "layernorm":
        y, result, plan = layer.replay_layer_norm(d["x"], d["w"], d["b"], 1e-5, dtype=dtype,
                                                  lnc=lnc, generation=generation, **params)
        _close(y, _layer_ref(d["x"], d["w"], d["b"], 1e-5), dtype)
        _check_replay(result, plan, lnc, 1)
    else:
        out, res_out, result, plan = add_rms.replay_add_rms_norm(
            d["x"], d["r"], d["w"], 1e-6, dtype=dtype, lnc=lnc, generation=generation, **params)
        total = d["x"].astype(np.float64) + d["r"]
        _close(res_out, total, dtype)
        _close(out, _rms_ref(total, d["w"], 1e-6), dtype)
        _check_replay(result, plan, lnc, 2)


OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
# Every awkward (rows, hidden) pair for every op, cycling through LNC degree, dtype and tunables.
SHAPE_CASES = [
    (op, (rows, hidden), ("float32", "bfloat16")[i % 2], 1 + (i // 2) % 2, TUNABLE_POINTS[i % 6])
    for op in OPS
    for i, (rows, hidden) in enumerate(itertools.product(ROWS, HIDDENS))
]


@pytest.mark.parametrize(("op", "shape", "dtype", "lnc", "params"), SHAPE_CASES, ids=str)
def test_replay_model_awkward_shapes(op, shape, dtype, lnc, params):
    _run(op, shape, dtype, lnc, "trn2", params, seed=sum(shape))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("params", TUNABLE_POINTS, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_replay_model_every_tunable_point(op, params, lnc, dtype):
    _run(op, (3, 43, 1000), dtype, lnc, "trn1", params, seed=lnc)  # 3-D, 129 rows


@pytest.mark.parametrize(("op", "hidden"), [("rmsnorm", 25_000), ("layernorm", 15_500)])
def test_replay_model_streamed_plan_rereads_x_when_the_tile_cannot_stay(op, hidden):
    plan = (rms if op == "rmsnorm" else layer).nki_tiling.make_plan(
        3, hidden, 2048, "rows", lnc=2, budget=SBUF_PARTITION_BYTES["trn1"], x_bytes=4, w_bytes=4)
    assert not plan.resident and plan.x_reads == (2 if op == "rmsnorm" else 3)
    _run(op, (3, hidden), "float32", 2, "trn1", dict(free_chunk=2048, lnc_split="rows"), seed=7)


def test_replay_model_resident_on_trn2_where_trn1_streams():
    kwargs = dict(lnc=1, x_bytes=4, w_bytes=4)
    assert not rms.nki_tiling.make_plan(128, 25_000, 512, "rows", budget=192 * 1024,
                                        **kwargs).resident
    assert rms.nki_tiling.make_plan(128, 25_000, 512, "rows", budget=224 * 1024, **kwargs).resident


def test_replay_model_lnc2_splits_rows_between_programs():
    d = _inputs((300, 64), "float32", 1)
    _, split, _ = rms.replay_rms_norm(d["x"], d["w"], 1e-6, dtype="float32", lnc=2,
                                      generation="trn2", free_chunk=512, lnc_split="rows")
    _, alone, _ = rms.replay_rms_norm(d["x"], d["w"], 1e-6, dtype="float32", lnc=2,
                                      generation="trn2", free_chunk=512, lnc_split="none")
    assert all(peak > 0 for peak in split.sbuf_peak)  # both programs hold tiles
    assert alone.sbuf_peak[1] == 0  # program 1 returned at once
    assert split.calls["nisa.dma_copy"] > alone.calls["nisa.dma_copy"]  # one weight load each


# --- The model must refuse what the documented API refuses ---

NL = ("ndarray", "sbuf", "shared_hbm", "float32", "square", "rsqrt", "add")
NISA = ("dma_copy", "activation", "memset")


def _replay_tiny(source: str, generation: str = "trn2") -> nki_replay.Replay:
    """Replay a small kernel whose body is `source`, on a 4 x 8 input, writing `out`."""
    lines = ["def kernel(x):", "    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)"]
    lines += [f"    {line}" for line in source.splitlines()] + ["    return out"]
    scope: dict[str, object] = {}
    exec("\n".join(lines), scope)
    return nki_replay.replay(scope["kernel"], [(np.ones((4, 8), np.float32), "float32")], [],
                             lnc=1, generation=generation, nl_names=NL, nisa_names=NISA)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)\n"
         "nisa.dma_copy(dst=t[0:4, 0:4], src=x)", "source elements"),
        ("t = nl.ndarray((129, 8), dtype=nl.float32, buffer=nl.sbuf)", "partitions"),
        ("t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)\n"
         "nisa.dma_copy(dst=t, src=x[0:5, :])", "out of bounds"),
        ("t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)\n"
         "nisa.dma_copy(t, x, 0, 0, 0, 0, 0, 0)", "positional"),
        ("nisa.activation(dst=out, op=nl.square, data=x)", "engines read and write SBUF"),
        ("t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)\n"
         "nisa.dma_copy(dst=t, src=x)\n"
         "nisa.activation(dst=t, op=nl.add, data=t)", "not an activation function"),
        ("t = nl.ndarray((4, 60000), dtype=nl.float32, buffer=nl.sbuf)\n"
         "nisa.memset(dst=t, value=0.0)", "SBUF bytes per partition"),
        ("t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)\n"
         "nisa.tensor_copy(dst=t, src=x)", "tensor_copy"),
    ],
    ids=["dma-count", "129-partitions", "oob-slice", "bad-signature", "hbm-operand", "alu-as-act",
         "sbuf-budget", "undeclared-name"],
)
def test_replay_model_refuses_what_nki_refuses(source, fragment):
    with pytest.raises((ModelError, AttributeError), match=fragment):
        _replay_tiny(source)


def test_replay_model_scalar_bias_only_from_neuroncore_v3():
    source = ("t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)\n"
              "nisa.dma_copy(dst=t, src=x)\n"
              "nisa.activation(dst=t, op=nl.rsqrt, data=t, bias=1e-6)\n"
              "nisa.dma_copy(dst=out, src=t)")
    result = _replay_tiny(source, generation="trn2")
    np.testing.assert_allclose(result.outputs[0], 1 / np.sqrt(1 + 1e-6), rtol=1e-6)
    with pytest.raises(ModelError, match="NeuronCore-v3"):
        _replay_tiny(source, generation="trn1")


def test_replay_model_unwritten_output_is_caught():
    source = ("t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)\n"
              "nisa.dma_copy(dst=t, src=x)\n"
              "nisa.dma_copy(dst=out[0:3, :], src=t[0:3, :])")
    with pytest.raises(ModelError, match="written"):
        _replay_tiny(source)


def test_replay_model_bf16_rounds_to_nearest_even():
    values = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9], dtype=np.float32)
    got = nki_replay.DTYPES["bfloat16"].round(values)
    np.testing.assert_array_equal(got, [1.0, 1.0, 1 + 2**-6, 1.0])


def test_replay_model_offers_only_declared_names():
    for module in (rms, layer, add_rms):
        assert set(module.TUNABLES) == {"free_chunk", "lnc_split"}
        assert "affine_range" not in module.NL_NAMES  # deprecated; loops are plain range
    assert PMAX == 128


SIM_CASES = [("rmsnorm", (129, 1000)), ("layernorm", (300, 5000)), ("add_rmsnorm", (1, 4096))]


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize(("op", "shape"), SIM_CASES, ids=str)
def test_simulator_matches_float64_reference(op, shape, lnc):
    module = {"rmsnorm": rms, "layernorm": layer, "add_rmsnorm": add_rms}[op]
    reason = module.simulator_unavailable_reason()
    if reason is not None:
        pytest.skip(f"AWS's nki.simulate is not importable: {reason}")
    d = _inputs(shape, "float32", 3)
    params = dict(free_chunk=2048, lnc_split="rows")
    if op == "rmsnorm":
        _close(rms.simulate_rms_norm(d["x"], d["w"], 1e-6, lnc=lnc, **params),
               _rms_ref(d["x"], d["w"], 1e-6), "float32")
    elif op == "layernorm":
        _close(layer.simulate_layer_norm(d["x"], d["w"], d["b"], 1e-5, lnc=lnc, **params),
               _layer_ref(d["x"], d["w"], d["b"], 1e-5), "float32")
    else:
        out, res_out = add_rms.simulate_add_rms_norm(d["x"], d["r"], d["w"], 1e-6, lnc=lnc,
                                                     **params)
        total = d["x"].astype(np.float64) + d["r"]
        _close(res_out, total, "float32")
        _close(out, _rms_ref(total, d["w"], 1e-6), "float32")
