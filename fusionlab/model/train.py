"""A causal LM's training step: forward on token ids, cross-entropy of each position's logits
against the next token, backward, AdamW step. The batches are drawn once from a seed and the
dropout generator is seeded per batch, so two copies of a model see exactly the same steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusionlab.errors import UserError


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a training step updates; a model without any cannot be trained."""
    found = [p for p in model.parameters() if p.requires_grad]
    if not found:
        raise UserError(
            f"{type(model).__name__} has no trainable parameters (every requires_grad is False): "
            "--train times a training step; unfreeze some, or bench inference without --train"
        )
    return found


def check_lengths(lengths: list[int]) -> None:
    """Refuse sequences too short to have a next token to predict."""
    if min(lengths) < 2:
        raise UserError(f"--train needs at least 2 tokens per sequence (got {min(lengths)}): "
                        "each position's loss is against the next token")


def token_batches(vocab: int, tokens: int, count: int, seed: int) -> list[torch.Tensor]:
    """`count` batches of one sequence of `tokens` random token ids."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, tokens), generator=generator) for _ in range(count)]


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token, in float32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


class Trainer:
    """One model, its own AdamW, and the batches it trains on."""

    def __init__(self, model: nn.Module, batches: list[torch.Tensor], seed: int,
                 lr: float = 1e-4) -> None:
        self.model, self.batches, self.seed = model, batches, seed
        self.optimizer = torch.optim.AdamW(trainable_parameters(model), lr=lr)

    def forward(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the loss of batch `index`, the graph kept for backward."""
        ids = self.batches[index].to(next(self.model.parameters()).device)
        torch.manual_seed(self.seed + index)  # the same dropout masks in every copy
        logits = self.model(ids, use_cache=False).logits
        return logits, next_token_loss(logits, ids)

    def backward(self, index: int) -> torch.Tensor:
        """Forward, loss and backward on batch `index` (gradients set, not accumulated); the
        logits, detached."""
        self.model.zero_grad(set_to_none=True)
        logits, loss = self.forward(index)
        loss.backward()
        return logits.detach()

    def step(self, index: int) -> None:
        """A full training step on batch `index`."""
        self.backward(index)
        self.optimizer.step()
