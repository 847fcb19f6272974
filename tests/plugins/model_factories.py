"""Model factories for `fusionlab capture --model FILE:FUNCTION`: a small non-transformers net
with its example inputs, a transformers causal LM taking typed keyword arguments, and factories
that fail the ways a user's can."""

import torch
from torch import nn


class NormedMLP(nn.Module):
    """Linear -> RMSNorm -> Linear -> LayerNorm: two replaceable norms outside transformers."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.rms = nn.RMSNorm(hidden, eps=eps)
        self.down = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.down(self.rms(self.up(x))))


def normed_mlp(hidden: int = 32, eps: float = 1e-6) -> nn.Module:
    return NormedMLP(hidden, eps)


def mlp_inputs(model: NormedMLP) -> tuple[torch.Tensor]:
    return (torch.randn(3, 5, model.up.in_features),)


def llama(hidden_size: int = 32, rms_norm_eps: float = 1e-6, tie: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=64, rms_norm_eps=rms_norm_eps, tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


def raises() -> nn.Module:
    raise RuntimeError("the checkpoint server is down")


def not_a_module() -> int:
    return 42


def frozen_llama() -> nn.Module:
    """A causal LM with every parameter frozen: nothing for a training step to update."""
    return llama().requires_grad_(False)
