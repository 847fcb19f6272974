"""The `fusionlab` command line. User errors become one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from fusionlab.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"fusionlab: {message} (see fusionlab {self.prog.split()[-1]} --help)\n")


def _add_plugin(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE",
        help="a Python file that registers ops or variants (repeatable)",
    )


def _add_ranking(parser: argparse.ArgumentParser) -> None:
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


def _add_width(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wide", action="store_true", help="every column, however wide the terminal"
    )
    parser.add_argument(
        "--columns",
        metavar="A,B,C",
        help="exactly these columns (the table's footer names the ones left out)",
    )


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", help="the op, e.g. rmsnorm (see fusionlab list)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or neuron (default auto)")
    _add_plugin(parser)
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


def _add_model_source(parser: argparse.ArgumentParser, *, again: bool) -> None:
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


def _add_model_commands(commands: argparse._SubParsersAction) -> None:
    """The `capture` and `bench-model` subcommands."""
    cap = commands.add_parser("capture", help="record a model's norm calls, numerics and times")
    _add_model_source(cap, again=False)
    cap.add_argument("--threads", type=int, help="cpu threads (default: what torch uses)")
    cap.add_argument("-o", "--output", default="capture.json", help="the capture file to write")
    _add_plugin(cap)

    bench = commands.add_parser(
        "bench-model", help="patch a captured model with the winners and time it end to end"
    )
    bench.add_argument("--capture", required=True, help="a file written by `fusionlab capture`")
    _add_model_source(bench, again=True)
    bench.add_argument("--storage", help="Optuna storage URL (default sqlite:///fusionlab.db)")
    bench.add_argument("--winners", help="a winners file (`fusionlab export OP --format json`)")
    bench.add_argument("--ops", help="comma-separated ops to patch (default: all captured)")
    bench.add_argument("--runs", type=int, default=30, help="alternating runs per step")
    bench.add_argument(
        "--fuse", action="store_true",
        help="time six configurations side by side: eager, patched, patched + fused (each "
        "decoder layer's add + norm as one add_rmsnorm / add_layernorm call), torch.compile, "
        "compile + patched, compile + the fused pass (needs the fused op's sweep results; see "
        "docs/fusion.md); with --train: training patched + fused against unpatched",
    )
    bench.add_argument(
        "--compile-backend", choices=("inductor", "eager"),
        help="the compiler of the --fuse compiled configurations (default inductor; eager runs "
        "dynamo's graphs as traced, for quick checks)",
    )
    bench.add_argument(
        "--train", action="store_true",
        help="time full training steps (forward, next-token cross-entropy, backward, AdamW) "
        "patched vs an unpatched copy, with peak memory and every parameter's gradient compared; "
        "exit code 1 when a gradient differs beyond its tolerance",
    )
    bench.add_argument("--threads", type=int, help="cpu threads (default: the capture's)")
    _add_plugin(bench)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fusionlab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sweep = commands.add_parser("sweep", help="measure every variant across shapes and dtypes")
    _add_common(sweep)
    sweep.add_argument("--shapes", help="comma-separated, e.g. 1x4096,4x2048x4096")
    sweep.add_argument(
        "--from-capture",
        metavar="FILE",
        help="sweep exactly the shapes, dtypes and threads a `fusionlab capture` file recorded",
    )
    sweep.add_argument("--dtypes", help="comma-separated, e.g. float32,bfloat16")
    sweep.add_argument("--variants", help="comma-separated subset of variants (default: all)")
    sweep.add_argument(
        "--pass",
        dest="pass_name",
        default="forward",
        metavar="PASS",
        help="what each call times, recorded in every cell: forward (default), backward (from a "
        "saved forward, a fresh upstream gradient each call) or forward+backward",
    )
    sweep.add_argument(
        "--trials",
        type=int,
        default=40,
        help="TPE budget per cell when its space is too large to enumerate",
    )
    sweep.add_argument("--storage", help="Optuna storage URL (default sqlite:///fusionlab.db)")
    sweep.add_argument("--fresh", action="store_true", help="measure again what is already stored")
    sweep.add_argument("--quick", action="store_true", help="a small sweep that ends in seconds")
    sweep.add_argument(
        "--no-screen",
        dest="screen",
        action="store_false",
        help="measure every configuration in full (default: a brief screen first, and in full "
        "only what is within 1.5x of the best measured in full in its cell)",
    )
    sweep.add_argument(
        "--export", metavar="FILE", help="also write the table (format by extension)"
    )
    sweep.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="local workers, one per device (needs a journal: or PostgreSQL storage)",
    )
    sweep.add_argument(
        "--pin", action="store_true", help="cpu: give each worker its own cores"
    )
    _add_ranking(sweep)
    _add_width(sweep)

    worker = commands.add_parser("worker", help="join a sweep planned in a shared storage")
    worker.add_argument("--storage", required=True, help="the sweep's storage URL")
    worker.add_argument("--op", help="join only this op's sweeps")
    worker.add_argument(
        "--plan", metavar="ID", help="join only this sweep plan (a sweep's own workers get it)"
    )

    status = commands.add_parser("status", help="what a sweep has done, is running and has left")
    status.add_argument("--storage", required=True, help="the sweep's storage URL")
    status.add_argument("--op", help="only this op's cells")

    export = commands.add_parser("export", help="render stored results without measuring")
    export.add_argument("op")
    export.add_argument(
        "--format", help="md, csv, json, latex or html (default: by extension, else md)"
    )
    export.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    export.add_argument("--storage", help="Optuna storage URL (default sqlite:///fusionlab.db)")
    _add_plugin(export)
    _add_ranking(export)
    _add_width(export)

    report = commands.add_parser(
        "report", help="an HTML page of stored results with plots (opens offline)"
    )
    report.add_argument("op")
    report.add_argument(
        "-o", "--output", default="report.html", metavar="FILE", help="default report.html"
    )
    report.add_argument("--plots", metavar="DIR", help="also write each plot as SVG and PNG here")
    report.add_argument("--storage", help="Optuna storage URL (default sqlite:///fusionlab.db)")
    _add_plugin(report)
    report.add_argument(
        "--rank-by",
        choices=("cold", "warm"),
        default="cold",
        help="rank by the cache-cold median (default) or the warm one",
    )

    _add_model_commands(commands)

    listing = commands.add_parser("list", help="ops and variants, and whether each runs here")
    _add_plugin(listing)
    listing.add_argument("--op", help="only this op's variants")
    listing.add_argument("--device", help="only variants for this device type (cpu, cuda, ...)")
    listing.add_argument("--wide", action="store_true", help="every column, descriptions too")

    for name, text in (
        ("compare", "profile every variant side by side at one shape"),
        ("profile", "profile one variant in depth"),
    ):
        command = commands.add_parser(name, help=text)
        _add_common(command)
        command.add_argument("--shape", required=True, help="e.g. 4x2048x4096")
        command.add_argument("--dtype", default="float32")
        if name == "compare":
            command.add_argument("--variants", help="comma-separated (default: all available)")
        else:
            command.add_argument("--variant", required=True)
            command.add_argument(
                "--param",
                action="append",
                default=[],
                metavar="NAME=VALUE",
                help="a tunable value (default: the first choice of each)",
            )
        command.add_argument("--trace-dir", help="write a Chrome trace (Perfetto) per variant here")
        command.add_argument("--rows", type=int, default=12, help="rows of each key_averages table")
        command.add_argument(
            "--wide", action="store_true", help="every column, however wide the terminal"
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fusionlab` command."""
    args = build_parser().parse_args(argv)
    try:
        from fusionlab import commands

        return commands.run(args)
    except UserError as error:
        print(f"fusionlab: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
