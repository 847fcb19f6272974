"""Argument groups several commands share, and the checks of their values."""

from __future__ import annotations

import argparse

from fusionlab.errors import UserError


def add_plugin(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE",
        help="a Python file that registers ops or variants (repeatable)",
    )


def add_ranking(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rank-by",
        choices=("cold", "warm"),
        default="cold",
        help="rank by the cache-cold median (default) or the warm one",
    )
    parser.add_argument(
        "--calls",
        type=int,
        metavar="N",
        help="rank by first use (build + compile + first call) + N x latency",
    )
    parser.add_argument(
        "--memory-budget",
        type=float,
        metavar="MB",
        help="backward passes: the fastest whose saved + peak memory fits MB megabytes",
    )


def add_width(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wide", action="store_true", help="every column, however wide the terminal"
    )
    parser.add_argument(
        "--columns",
        metavar="A,B,C",
        help="exactly these columns (the table's footer names the ones left out)",
    )


def add_common(parser: argparse.ArgumentParser) -> None:
    """The op and how its trials run: sweep, compare and profile."""
    parser.add_argument("op", help="the op, e.g. rmsnorm (see fusionlab list)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or neuron (default auto)")
    add_plugin(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated inputs")
    parser.add_argument(
        "--threads",
        type=int,
        help="cpu: intra-op threads every trial runs with, recorded in every cell (default: "
        "what torch uses here; with --pin, the cores each worker gets)",
    )
    parser.add_argument(
        "--allocator",
        choices=("fixed", "default", "thp"),
        help="cpu: the host allocator the measuring process starts with, recorded in every "
        "cell: fixed (default: glibc's malloc thresholds pinned), default (glibc's own), thp "
        "(glibc's own and torch's transparent huge pages)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds one trial may take, compile included (default: the device's, 300 on "
        "cpu and cuda, 1800 on neuron)",
    )


def add_one_cell(parser: argparse.ArgumentParser) -> None:
    """The op, how its trials run, and the one shape and dtype compare and profile look at."""
    add_common(parser)
    parser.add_argument("--shape", required=True, help="e.g. 4x2048x4096")
    parser.add_argument("--dtype", default="float32")


def add_investigation_output(parser: argparse.ArgumentParser) -> None:
    """Where compare and profile write traces, and how much of each table they print."""
    parser.add_argument("--trace-dir", help="write a Chrome trace (Perfetto) per variant here")
    parser.add_argument("--rows", type=int, default=12, help="rows of each key_averages table")
    parser.add_argument(
        "--wide", action="store_true", help="every column, however wide the terminal"
    )


def add_model_source(parser: argparse.ArgumentParser, *, again: bool) -> None:
    """--model and what makes it (for bench-model: each defaults to the capture's own)."""
    default = " (default: the capture's)" if again else ""
    parser.add_argument(
        "--model", required=not again,
        help="llama-tiny, gemma-tiny or gpt2-tiny (random weights, no download); a folder written "
        "by save_pretrained (its weights, or random ones if it holds only config.json); or "
        "module:function / file.py:function returning an nn.Module" + default,
    )
    parser.add_argument(
        "--config", metavar="NAME=VALUE,...",
        help="config settings typed from the config class (or the factory's keyword arguments), "
        "e.g. hidden_size=1024,rms_norm_eps=1e-6,tie_word_embeddings=false" + default,
    )
    parser.add_argument("--dtype", help="float32 (default for transformers models), bfloat16 or "
                        "float16; a factory's model keeps its own dtype unless given" + default)
    fallback = "the capture's, else " if again else ""
    parser.add_argument("--tokens", metavar="N[,N...]",
                        help="prompt lengths of the prefill steps, e.g. 128 or 16,128 "
                        f"(default: {fallback}128)")
    parser.add_argument("--inputs", metavar="module:function",
                        help="the example inputs of a model that is not a causal LM (a tensor, "
                        "tuple or dict; the function may take the model)" + default)
    parser.add_argument("--seed", type=int,
                        help=f"seed of the weights and token ids (default: {fallback}0)")


def check_calls(calls: int | None) -> None:
    if calls is not None and calls < 1:
        raise UserError(f"--calls must be at least 1 (got {calls})")


def check_memory_budget(budget_mb: float | None, pass_name: str | None) -> None:
    """A budget is a positive number of MB, for a pass that has a backward (None: any pass)."""
    if budget_mb is None:
        return
    if not budget_mb > 0:
        raise UserError(f"--memory-budget must be a positive number of MB (got {budget_mb:g})")
    if pass_name == "forward":
        raise UserError("--memory-budget ranks backward passes (their memory is measured); "
                        "add --pass backward or --pass forward+backward")
