"""An rmsnorm variant that counts its calls (to see that a patched model really calls the
winner); it declares no autograd, as a hand-written kernel without a backward would."""

import torch

from fusionlab import register_variant

CALLS = [0]


def _counting(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    CALLS[0] += 1
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


@register_variant("rmsnorm", "counting", devices=("cpu",))
def counting(device_type: str):
    """torch.rms_norm, counting its calls."""
    return _counting
