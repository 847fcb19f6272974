"""The framework lowerings every norm op registers, on every device: its naive ATen chain (the
baseline every speedup is measured against), the framework's own builtin, and torch.compile of
the naive chain. What differs per op: the chain and the builtin, those for other numerics, the
casting modes each implements, and which numerics need inductor to keep every 16-bit rounding."""

from __future__ import annotations

from collections.abc import Callable

from fusionlab.kernels.compiling import COMPILE_TUNABLES, compile_rejects, compiled_copy
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics
from fusionlab.registry import Kernel, register_variant

DEVICES = ("cpu", "cuda", "neuron")
BUILTIN_CASTING_MODES = ("none", "gemma")
"""The casting modes of a builtin with numerics: torch.rms_norm cannot round the normalised row."""
Lowering = Callable[[Numerics], Kernel]


def _never_exact(numerics: Numerics) -> bool:
    return False


def register_framework_variants(
    op: str, naive: Kernel, builtin: Kernel, descriptions: tuple[str, str, str], *,
    naive_with: Lowering | None = None, builtin_with: Lowering | None = None,
    exact_casts: Callable[[Numerics], bool] = _never_exact,
    before_compiled: Callable[[], object] | None = None,
) -> None:
    """Register `op`'s variants naive (the chain `naive`), builtin (`builtin`) and compiled
    (torch.compile of the chain), described by `descriptions` in that order; under numerics other
    than the default, the chain is `naive_with(numerics)` (every casting mode) and the builtin
    `builtin_with(numerics)` (BUILTIN_CASTING_MODES). `before_compiled` registers the variants
    listed between builtin and compiled."""
    numerics = ("none",) if naive_with is None else CASTING_MODES
    builtin_numerics = ("none",) if builtin_with is None else BUILTIN_CASTING_MODES

    naive_what, builtin_what, compiled_what = descriptions

    def chain(numerics: Numerics) -> Kernel:
        if numerics == DEFAULT:
            return naive
        assert naive_with is not None, f"{op}'s naive chain takes no numerics"
        return naive_with(numerics)

    def naive_lowering(device_type: str, numerics: Numerics = DEFAULT) -> Kernel:
        return chain(numerics)

    def builtin_lowering(device_type: str, numerics: Numerics = DEFAULT) -> Kernel:
        if numerics == DEFAULT:
            return builtin
        if numerics.rounds_normed:
            raise ValueError(f"builtin {op} cannot round the normalised row (casting 'llama')")
        assert builtin_with is not None, f"{op}'s builtin takes no numerics"
        return builtin_with(numerics)

    def compiled(device_type: str, mode: str, dynamic: bool,
                 numerics: Numerics = DEFAULT) -> Kernel:
        return compiled_copy(chain(numerics), device_type, mode, dynamic, exact_casts(numerics))

    register_variant(op, "naive", devices=DEVICES, kind="baseline", numerics=numerics,
                     description=naive_what)(naive_lowering)
    register_variant(op, "builtin", devices=DEVICES, kind="builtin", numerics=builtin_numerics,
                     description=builtin_what)(builtin_lowering)
    if before_compiled is not None:
        before_compiled()
    register_variant(op, "compiled", devices=DEVICES, tunables=COMPILE_TUNABLES,
                     check_params=compile_rejects, kind="compiled", numerics=numerics,
                     description=compiled_what)(compiled)
