"""The registration helper of the hand-written kernels (kernels/common/registration.py) and the
pick of a fused backward (kernels/common/backward_choices.py)."""

from __future__ import annotations

import pytest

from fusionlab.kernels.common.backward_choices import fused_backward
from fusionlab.kernels.common.registration import with_numerics
from fusionlab.numerics import Numerics
from fusionlab.registry import get_variant

TILE = {"block_size": 64, "rows_per_program": 1, "threads_per_row": 32}


def test_the_backward_tunable_never_reaches_the_kernels_parameter_check() -> None:
    triton = get_variant("rmsnorm", "triton")
    assert triton.backward_tunables == {"backward": ("torch-ops", "fused")}
    assert triton.rejects((4, 64), {**TILE, "backward": "fused"}, "cuda") is None
    wrong = triton.rejects((4, 64), {**TILE, "block_size": 128, "backward": "fused"}, "cuda")
    assert wrong is not None and wrong.startswith("block_size 128 != 64")


def test_a_variant_without_backward_choices_checks_every_parameter() -> None:
    nki = get_variant("add_rmsnorm", "nki")
    assert nki.backward_tunables == {}
    assert nki.tunables == {"free_chunk": (512, 2048, 8192), "lnc_split": ("rows", "none")}
    assert nki.unavailable_reason("neuron") is not None  # no Neuron toolchain here


def test_torch_ops_picks_no_fused_kernel_and_loads_nothing() -> None:
    loads: list[str] = []
    assert fused_backward("torch-ops", {"fused": print}, lambda: loads.append("x")) is None
    assert loads == []
    assert fused_backward("fused", {"fused": print}, lambda: loads.append("x")) is print
    assert loads == ["x"]


def test_an_unknown_backward_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="one of torch-ops, fused, fused-saved, got 'saved'"):
        fused_backward("saved", {"fused": print, "fused-saved": print})


def test_with_numerics_binds_casting_and_offset_only_when_given() -> None:
    def kernel(**kwargs: object) -> dict[str, object]:
        return kwargs

    assert with_numerics(kernel, None, {"rows_per_task": 4})() == {"rows_per_task": 4}
    gemma = Numerics(casting="gemma", offset=1.0)
    assert with_numerics(kernel, gemma, {"rows_per_task": 4})() == {
        "casting": "gemma", "offset": 1.0, "rows_per_task": 4}
