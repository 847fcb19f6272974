"""What the model benchmarks share: the size, length, rounds and variants of the random Llama they
run (their command-line arguments) and its config. A benchmark runs as a script
(`python benchmarks/<name>.py`), so this folder is on its import path."""

from __future__ import annotations

import argparse


def add_llama_arguments(parser: argparse.ArgumentParser, *, runs: int,
                        tokens: int | str = 128, tokens_help: str | None = None) -> None:
    """--hidden, --layers, --tokens (an int, or a string with `tokens_help`), --runs and
    --variants."""
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    if isinstance(tokens, int):
        parser.add_argument("--tokens", type=int, default=tokens)
    else:
        parser.add_argument("--tokens", default=tokens, help=tokens_help)
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--variants", default="builtin,naive,cpp")


def llama_config(args: argparse.Namespace) -> dict[str, int]:
    """The config overrides of a Llama of `args.hidden` and `args.layers`."""
    return {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
            "num_hidden_layers": args.layers, "num_attention_heads": 8,
            "num_key_value_heads": 4}
