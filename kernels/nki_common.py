"""Pieces every NKI kernel module shares: LNC degree, SBUF budget, availability, torch launch.

Written against AWS Neuron SDK 2.33 (NKI 0.7.0, torch-neuronx 2.14). Sources, read 2026-12:
- LNC degree: awsdocs-neuron v2.33.1 nki/api/generated/nki.jit ("Configure the LNC degree by
  setting NEURON_LOGICAL_NC_CONFIG to 1 or 2 before invoking the kernel. If the LNC degree is not
  explicitly set, the default is LNC=1"); compiler/error-codes/EVRF066 (NKI 0.7.0 rejects a kernel
  whose degree differs from neuronx-cc's; neuronx-cc defaults to LNC=2 on Trn2 and later; the
  bracket syntax ``kernel[lnc](...)`` still works but "is being deprecated");
  nki/get-started/about/lnc (degree is 1 or 2; nl.program_id / nl.num_programs split the work);
  about-neuron/arch/neuron-features/logical-neuroncore-config (the runtime reads
  NEURON_LOGICAL_NC_CONFIG; the compiler must use the same degree). No TorchNeuron Python API that
  reports the degree is documented, so the environment variable is what is read.
- Target: nki.jit docstring (aws-neuron/aws-neuron-sdk nki/api/nki/__init__.py, SDK 2.32 stubs):
  NEURON_PLATFORM_TARGET_OVERRIDE = trn1|inf2|gen2, trn2|gen3, trn3|gen4.
- SBUF per partition: nki/about/trainium2_arch: 24 MiB = 128 x 192 KiB on NeuronCore-v2 (Trn1),
  28 MiB = 128 x 224 KiB on NeuronCore-v3 (Trn2). No Trn3 figure was found, so Trn3 gets the
  smaller documented budget rather than a guess.
- torch launch: torch/guides/how-to-work-with-nki and torch/get-started/quickstart-nki-kernel:
  call the ``@nki.jit`` kernel on neuron tensors inside a
  ``torch_neuronx.nki_op(name, mutates_args=...)`` custom op; eager calls compile once per shape
  and constant arguments.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

PMAX = 128  # nl.tile_size.pmax: partitions per tile
SBUF_PARTITION_BYTES = {"trn1": 192 * 1024, "trn2": 224 * 1024, "trn3": 192 * 1024}
MIN_SBUF_PARTITION_BYTES = min(SBUF_PARTITION_BYTES.values())
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
_TARGETS = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2",
            "trn3": "trn3", "gen4": "trn3"}
_NOT_ON_PYPI = "it comes from AWS's Neuron repository, not PyPI"


def generation(environ: dict[str, str] | None = None) -> str:
    """trn1, trn2 or trn3 from NEURON_PLATFORM_TARGET_OVERRIDE; trn2 (TorchNeuron's floor) unset."""
    value = (os.environ if environ is None else environ).get(TARGET_ENV, "").strip().lower()
    if not value:
        return "trn2"
    if value not in _TARGETS:
        raise ValueError(f"{TARGET_ENV}={value!r} is not one of {sorted(_TARGETS)}")
    return _TARGETS[value]


def sbuf_partition_bytes(gen: str) -> int:
    """Documented SBUF bytes per partition for a generation (see the module docstring)."""
    return SBUF_PARTITION_BYTES[gen]


def lnc_degree(environ: dict[str, str] | None = None) -> tuple[int, str]:
    """The LNC degree neuronx-cc and the runtime will use, and where it came from.

    NEURON_LOGICAL_NC_CONFIG when set; otherwise neuronx-cc's default: 1 on Trn1, 2 on Trn2+.
    """
    env = os.environ if environ is None else environ
    value = env.get(LNC_ENV, "").strip()
    if value:
        if value not in ("1", "2"):
            raise ValueError(f"{LNC_ENV}={value!r}: the Neuron SDK supports LNC degree 1 or 2")
        return int(value), f"{LNC_ENV}={value}"
    gen = generation(env)
    default = 1 if gen == "trn1" else 2
    return default, f"neuronx-cc default for {gen} ({LNC_ENV} unset)"


def _import_problem(names: tuple[str, ...], package: str, incomplete: str) -> str | None:
    """Why importing `names` (the first is the package, called `package` in messages) fails, or
    None; `incomplete` says why when a module other than the package itself is missing."""
    try:
        for name in names:
            importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == names[0]:
            return f"{package} is not installed ({_NOT_ON_PYPI})"
        return incomplete.format(exc=exc)
    except Exception as exc:  # a broken install must not crash whoever asks
        return f"{package} failed to import: {exc}"
    return None


def nki_problem(nl_names: Iterable[str], nisa_names: Iterable[str], *extra: str) -> str | None:
    """Why the real `nki` package lacks what a kernel uses (its exact nl/nisa names), or None."""
    problem = _import_problem(
        ("nki", "nki.isa", "nki.language"), "nki",
        "nki is incomplete, likely the PyPI placeholder ({exc}); " + _NOT_ON_PYPI)
    if problem is not None:
        return problem
    nki = sys.modules["nki"]
    needed = {nki: ("jit", *extra), nki.language: tuple(nl_names), nki.isa: tuple(nisa_names)}
    missing = [f"{m.__name__}.{a}" for m, names in needed.items() for a in names
               if not hasattr(m, a)]
    if missing:
        return (f"nki lacks {', '.join(missing)}: the PyPI placeholder or not the NKI 0.7.0 "
                f"release these kernels target (Neuron SDK 2.33); {_NOT_ON_PYPI}")
    return None


def torch_neuron_problem(nl_names: Iterable[str], nisa_names: Iterable[str]) -> str | None:
    """Why a kernel cannot run from torch here (torch-neuronx, nki, a device), or None."""
    problem = _import_problem(("torch_neuronx", "torch"), "torch-neuronx",
                              "torch-neuronx failed to import: {exc}")
    if problem is not None:
        return problem
    if not hasattr(sys.modules["torch_neuronx"], "nki_op"):
        return f"torch-neuronx has no nki_op: PyPI placeholder or older than 2.13; {_NOT_ON_PYPI}"
    problem = nki_problem(nl_names, nisa_names)
    if problem is not None:
        return problem
    neuron = getattr(sys.modules["torch"], "neuron", None)
    if neuron is None:
        return "torch.neuron is missing: torch-neuronx did not register the neuron device"
    try:
        available = bool(neuron.is_available())
    except Exception as exc:  # the runtime can fail without a driver; report, don't raise
        return f"torch.neuron.is_available() failed: {exc}"
    if not available:
        return "no Neuron device: torch.neuron.is_available() is False (needs Trn2 or Trn3)"
    return None


def bind_language(module_globals: dict[str, Any]) -> Any:
    """Bind the real nki.language / nki.isa as the kernel module's `nl` / `nisa`; return `nki`."""
    import nki
    import nki.isa
    import nki.language

    module_globals["nl"], module_globals["nisa"] = nki.language, nki.isa
    return nki


def launch(jit_kernel: Any, lnc: int) -> Callable[..., Any]:
    """The kernel launched at LNC degree `lnc` (kernel[lnc], the form NKI 0.7.0 still accepts)."""
    return jit_kernel if lnc == 1 else jit_kernel[lnc]


# --- Tiling arithmetic shared by every kernel (plain Python: the kernels call it while tracing) ---

# How rows are divided among the LNC programs. "rows": contiguous, near-equal shares, so both
# physical cores stream their own rows (wins once there are enough rows to keep both busy).
# "none": program 0 does every row and the others return at once, sparing a second core's fixed
# cost (its own weight broadcast) when the input is a handful of rows.
LNC_SPLITS = ("rows", "none")
# Elements per instruction on the free axis. 512: many small instructions, so the store of one
# chunk overlaps the compute of the next (wins on long rows, few tiles). 8192: one instruction per
# row tile up to hidden 8192, least fixed per-instruction cost (wins with many row tiles). 2048
# sits between.
FREE_CHUNKS = (512, 2048, 8192)
FP32_BYTES = 4


def ceil_div(n: int, d: int) -> int:
    """Number of size-`d` pieces needed to cover `n` items."""
    return (n + d - 1) // d


def span(index: int, size: int, total: int) -> tuple[int, int]:
    """[start, stop) of piece `index` when `total` items are cut into pieces of `size`."""
    start = index * size
    return start, min(start + size, total)


def program_rows(rows: int, lnc_split: str, program: int, programs: int) -> tuple[int, int]:
    """[start, stop) of the rows LNC program `program` of `programs` writes."""
    if lnc_split == "none":
        return (0, rows) if program == 0 else (0, 0)
    return rows * program // programs, rows * (program + 1) // programs


def tile_partitions(rows: int, lnc_split: str, programs: int) -> int:
    """Partitions one row tile uses: all 128 unless a program has fewer rows than that."""
    most = max(b - a for a, b in (program_rows(rows, lnc_split, p, programs)
                                  for p in range(programs)))
    return max(1, min(PMAX, most))


def tunable_error(free_chunk: Any, lnc_split: Any, choices: tuple[int, ...]) -> str | None:
    """Why `free_chunk` / `lnc_split` are not values these kernels accept, or None."""
    if not isinstance(free_chunk, int) or isinstance(free_chunk, bool):
        return f"free_chunk must be an int, got {free_chunk!r}"
    if free_chunk not in choices:
        return f"free_chunk {free_chunk} is not one of {choices}"
    if lnc_split not in LNC_SPLITS:
        return f"lnc_split {lnc_split!r} is not one of {LNC_SPLITS}"
    return None


def rows_and_hidden(shape: tuple[int, ...]) -> tuple[int, int] | str:
    """(rows, hidden) of a last-dim op over `shape`, or why the shape cannot be one."""
    if not shape:
        return "x must have at least one dimension"
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape):
        return f"every dimension must be an int >= 1, got {shape}"
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


@dataclass(frozen=True)
class Plan:
    """How a kernel runs one (rows, hidden, dtype) on one generation.

    resident: the x row tile stays in SBUF, so x is read from HBM once (the op's minimum);
    otherwise x is streamed chunk by chunk and read `x_reads` times.
    """

    rows: int
    hidden: int
    chunk: int
    n_chunks: int
    partitions: int
    resident: bool
    sbuf_bytes: int  # per partition, upper bound: streamed chunks counted twice, scratch once
    budget: int
    x_reads: int


def choose_plan(rows: int, hidden: int, free_chunk: int, lnc_split: str, *, lnc: int,
                budget: int, need: Callable[[int, bool], int], streamed_reads: int) -> Plan:
    """Resident when `need(chunk, True)` fits `budget`, else streamed; ValueError if neither."""
    chunk = min(free_chunk, hidden)
    resident = need(chunk, True) <= budget
    bytes_needed = need(chunk, resident)
    if bytes_needed > budget:
        raise ValueError(f"hidden {hidden} needs {bytes_needed} SBUF bytes per partition even "
                         f"streamed, over the {budget} budget")
    return Plan(rows, hidden, chunk, ceil_div(hidden, chunk), tile_partitions(rows, lnc_split, lnc),
                resident, bytes_needed, budget, 1 if resident else streamed_reads)


def budget_error(hidden: int, free_chunk: int, need: Callable[[int, bool], int]) -> str | None:
    """Why neither plan fits the smallest documented SBUF, or None (`need` given fp32 sizes)."""
    chunk = min(free_chunk, hidden)
    bytes_needed = min(need(chunk, True), need(chunk, False))
    if bytes_needed > MIN_SBUF_PARTITION_BYTES:
        return (f"hidden {hidden} with free_chunk {free_chunk} needs {bytes_needed} SBUF bytes per "
                f"partition in fp32, resident or streamed, over the "
                f"{MIN_SBUF_PARTITION_BYTES} budget")
    return None


ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(dtype: Any) -> str:
    """'float32' / 'bfloat16' / 'float16' for a torch dtype; ValueError for anything else."""
    name = str(dtype).removeprefix("torch.")
    if name not in ELEMENT_BYTES:
        raise ValueError(f"dtype {dtype} is not one of {sorted(ELEMENT_BYTES)}")
    return name


def shape_plan(tiling: Any, shape: tuple[int, ...], dtype: str, *, lnc: int, generation: str,
               **tunables: Any) -> Plan:
    """`tiling.make_plan` for a last-dim op over `shape` in `dtype` (weights counted as fp32)."""
    sizes = rows_and_hidden(tuple(shape))
    if isinstance(sizes, str):
        raise ValueError(sizes)
    return tiling.make_plan(*sizes, **tunables, lnc=lnc, budget=sbuf_partition_bytes(generation),
                            x_bytes=ELEMENT_BYTES[dtype], w_bytes=FP32_BYTES)


def shape_param_error(tiling: Any, tunable_names: Iterable[str], shape: tuple[int, ...],
                      params: dict[str, Any]) -> str | None:
    """A kernel module's `param_error(shape, **params)`, over its tiling's (rows, hidden) one."""
    sizes = rows_and_hidden(tuple(shape))
    if isinstance(sizes, str):
        return sizes
    if set(params) != set(tunable_names):
        return f"tunables must be exactly {sorted(tunable_names)}, got {sorted(params)}"
    return tiling.param_error(*sizes, **params)


def check_devices(*tensors: Any) -> None:
    """ValueError unless every tensor is on one neuron device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "neuron":
        raise ValueError(f"inputs must be on one neuron device, got {sorted(map(str, devices))}")
