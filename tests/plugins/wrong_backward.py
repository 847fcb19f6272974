"""An rmsnorm variant with a planted wrong backward: its forward is torch.rms_norm (so it patches
a model and predicts exactly as the module does), its backward returns dweight scaled by 1.5."""

import torch

from fusionlab import register_variant


class _ScaledWeightGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            out = torch.rms_norm(x, (x.shape[-1],), weight, ctx.eps)
            grad_x, grad_weight = torch.autograd.grad(out, (x, weight), grad)
        return grad_x, 1.5 * grad_weight, None


@register_variant("rmsnorm", "scaled_dweight", devices=("cpu",), autograd=True)
def scaled_dweight(device_type: str):
    """torch.rms_norm forward; dweight 1.5x too large."""
    return lambda x, weight, eps: _ScaledWeightGradient.apply(x, weight, eps)
