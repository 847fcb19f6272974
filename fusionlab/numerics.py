"""The numerics of the norm module a kernel replaces: where it rounds, and its weight offset.

Casting modes, named after Liger-Kernel's `casting_mode` (liger_kernel/ops/rms_norm.py), with
the formulas of the transformers modules they model:
- "none": fp32 statistics and products, one rounding to x's dtype at the end.
- "llama" (LlamaRMSNorm): the normalised row is rounded to x's dtype, then multiplied by the
  weight (`weight * x_normed.to(input_dtype)`), and the product rounded again.
- "gemma" (GemmaRMSNorm): fp32 throughout, `x_normed * (1 + weight.float())`, rounded once; use
  it with offset=1.0. For a fused add + RMSNorm, "llama" and "gemma" also round the sum to x's
  dtype before its statistics, as the model's own `residual + hidden_states` does.
Liger's "none" computes in the input dtype; fusionlab's "none" is its fp32 sweep formula.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusionlab.errors import UserError

CASTING_MODES = ("none", "llama", "gemma")


@dataclass(frozen=True)
class Numerics:
    """How the replaced module rounds (`casting`) and what it adds to its weight (`offset`)."""

    casting: str = "none"
    offset: float = 0.0

    def __post_init__(self) -> None:
        if self.casting not in CASTING_MODES:
            raise UserError(
                f"unknown casting mode {self.casting!r}: choose from {', '.join(CASTING_MODES)}"
            )

    @property
    def rounds_normed(self) -> bool:
        """The normalised row is rounded to the input dtype before the weight multiply."""
        return self.casting == "llama"

    @property
    def rounds_sum(self) -> bool:
        """A fused residual add rounds its sum to the input dtype before the norm."""
        return self.casting != "none"


DEFAULT = Numerics()
