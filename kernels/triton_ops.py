"""The torch.library glue the Triton norm ops share: their fake (meta) kernels and the autograd
setup that saves an op's inputs for its backward."""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels import norm_grads


def fake_rows(x: torch.Tensor, *args: Any, **tunables: Any) -> torch.Tensor:
    """The fake kernel of an op returning one tensor shaped like x."""
    return norm_grads.empty_like_rows(x)


def fake_row_pair(x: torch.Tensor, *args: Any,
                  **tunables: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake kernel of an op returning (out, residual_out), both shaped like x."""
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(x)


def fake_grads(grad_y: torch.Tensor, x: torch.Tensor, *args: Any,
               **tunables: Any) -> tuple[torch.Tensor, ...]:
    """The fake kernel of a backward op (dy, x, *vectors, eps): dx, then each vector's grad."""
    return norm_grads.empty_like_rows(x), *(torch.empty_like(a) for a in args
                                            if isinstance(a, torch.Tensor))


def save_inputs(ctx: Any, inputs: tuple[Any, ...], keyword_only_inputs: dict[str, Any],
                output: Any) -> None:
    """setup_context of an op taking (*tensors, eps, *, tile): saves the tensors, eps and the
    tile (ctx.tile, the keyword-only tunables) for its backward."""
    *tensors, eps = inputs
    ctx.save_for_backward(*tensors)
    ctx.eps = eps
    ctx.tile = keyword_only_inputs
