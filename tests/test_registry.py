"""Registering variants: the decorator, its validation, plugins and the tunable spaces."""

from pathlib import Path

import optuna.distributions as od
import pytest

from fusionlab import register_variant
from fusionlab.errors import RegistrationError, UserError
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm
from fusionlab.registry import get_variant, load_plugin, variants_of


def test_builtin_variants_are_registered_with_their_tunables() -> None:
    variants = variants_of("rmsnorm")
    assert {"naive", "builtin", "compiled", "cpp", "triton", "nki"} <= set(variants)
    compiled = variants["compiled"]
    assert len(list(compiled.configurations())) == 6
    assert compiled.rejects((4, 8), {"mode": "reduce-overhead", "dynamic": False}, "cpu")
    assert compiled.rejects((4, 8), {"mode": "default", "dynamic": True}, "cpu") is None
    assert variants["nki"].unavailable_reason("neuron")
    assert variants["triton"].unavailable_reason("cpu") == "runs on cuda only"


def test_decorator_registers_a_user_variant_with_a_continuous_space() -> None:
    @register_variant("rmsnorm", "test-user", devices=("cpu",),
                      tunables={"unroll": od.IntDistribution(1, 8), "alpha": (0.5, 1.0)})
    def user(device_type: str, unroll: int, alpha: float):
        return naive_rmsnorm

    variant = get_variant("rmsnorm", "test-user")
    assert variant.is_finite() and len(list(variant.configurations())) == 16
    assert {"unroll": 8, "alpha": 1.0} in list(variant.configurations())
    assert variant.description == ""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"op": "nope", "devices": ("cpu",)}, "unknown op"),
        ({"op": "rmsnorm", "devices": ("tpu",)}, "devices must be"),
        ({"op": "rmsnorm", "devices": ("cpu",), "tunables": {"k": []}}, "non-empty list"),
        ({"op": "rmsnorm", "devices": ("cpu",), "tunables": {"k": "abc"}}, "non-empty list"),
        ({"op": "rmsnorm", "devices": ("cpu",), "dtypes": ("int8",)}, "unknown dtypes"),
    ],
)
def test_invalid_registrations_are_refused(kwargs: dict, message: str) -> None:
    op = kwargs.pop("op")
    with pytest.raises(RegistrationError, match=message):
        register_variant(op, "test-invalid", **kwargs)(lambda device_type: naive_rmsnorm)


def test_a_taken_name_is_refused() -> None:
    with pytest.raises(RegistrationError, match="taken"):
        register_variant("rmsnorm", "naive", devices=("cpu",))(lambda device_type: naive_rmsnorm)


def test_a_failing_plugin_leaves_nothing_registered(tmp_path: Path) -> None:
    plugin = tmp_path / "half.py"
    plugin.write_text(
        "from fusionlab import register_variant\n"
        "register_variant('rmsnorm', 'test-half', devices=('cpu',))(lambda d: None)\n"
        "raise RuntimeError('boom')\n"
    )
    with pytest.raises(UserError, match=r"failed to import.*boom"):
        load_plugin(str(plugin))
    assert "test-half" not in variants_of("rmsnorm")


def test_missing_plugin_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_plugin(str(tmp_path / "absent.py"))
