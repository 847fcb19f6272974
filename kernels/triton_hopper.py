"""Compile the Triton kernels for Hopper (sm_90) without a GPU: registers, spills, occupancy.

`triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))`
(triton-lang/triton python/triton/compiler/compiler.py) lowers to PTX on any machine. The PTX is
then assembled by Triton's bundled ptxas with `-v` and the flags Triton's own make_cubin uses
(python/triton/backends/nvidia/compiler.py: `-lineinfo --regAllocOptLevel=2
--gpu-name=sm_90a`; Triton targets sm_90a, the arch-specific superset of sm_90), so the reported
registers and spill bytes are those of the cubin Triton would load. The compiled kernel's
metadata has no n_regs / n_spills offline: Triton reads them from the driver
(cuFuncGetAttribute) when the cubin is loaded, which needs a GPU.

Run as `python -m fusionlab.kernels.triton_hopper` (JSON on stdout). It must run without
TRITON_INTERPRET, because kernels decorated under the interpreter cannot be compiled.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Any

# H100 / H200 streaming multiprocessor (CUDA C Programming Guide, compute capability 9.0 table).
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
SM_MAX_WARPS = 64
SM_MAX_BLOCKS = 32
BLOCK_RESERVED_SHARED = 1024  # the runtime keeps 1 KB of shared memory per resident block
REGISTER_GRANULE = 256  # registers are allocated per warp in units of 256

HIDDEN_SIZES = (4096, 8192)
ROWS = 2048  # enough rows that every rows_per_program value is a legal point
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
_DTYPES = {"bfloat16": ("bf16", 2), "float32": ("fp32", 4)}


def _kernel(op: str) -> tuple[Any, Any]:
    """(tunable-space module, jitted kernel) of `op`."""
    if op == "rmsnorm":
        from fusionlab.kernels.rmsnorm import triton_kernel as mod

        return mod, mod._rms_norm_kernel
    if op == "layernorm":
        from fusionlab.kernels.layernorm import triton_kernel as mod

        return mod, mod._layer_norm_kernel
    from fusionlab.kernels.add_rmsnorm import triton_kernel as mod

    return mod, mod._add_rms_norm_kernel


def valid_points(op: str, hidden: int) -> list[dict[str, int]]:
    """Every tunable combination `op`'s param_error accepts at (ROWS, hidden)."""
    mod, _ = _kernel(op)
    names = list(mod.TUNABLES)
    product = itertools.product(*mod.TUNABLES.values())
    points = [dict(zip(names, values, strict=True)) for values in product]
    return [p for p in points if mod.param_error((ROWS, hidden), **p) is None]


def occupancy(registers: int, shared: int, num_warps: int) -> dict[str, Any]:
    """Resident warps per SM and what limits them, from registers, shared memory and block size."""
    regs_per_warp = math.ceil(registers * 32 / REGISTER_GRANULE) * REGISTER_GRANULE
    limits = {
        "warps": SM_MAX_WARPS // num_warps,
        "blocks": SM_MAX_BLOCKS,
        "registers": SM_REGISTERS // (regs_per_warp * num_warps),
        "shared": SM_SHARED_BYTES // (shared + BLOCK_RESERVED_SHARED),
    }
    blocks = min(limits.values())
    return {
        "blocks_per_sm": blocks,
        "warps_per_sm": blocks * num_warps,
        "occupancy": blocks * num_warps / SM_MAX_WARPS,
        "limited_by": min(limits, key=limits.get),
    }


def _ptxas(ptx: str) -> dict[str, int]:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(90).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(90)}", src, "-o", src + ".o"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if not (used and spills and stack):
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    return {
        "registers": int(used.group(1)),
        "spill_store_bytes": int(spills.group(1)),
        "spill_load_bytes": int(spills.group(2)),
        "stack_bytes": int(stack.group(1)),
    }


def _x_layout(ttgir: str, tile: dict[str, int]) -> dict[str, int]:
    """Threads per row and rows per program of the layout Triton chose for the x tile load."""
    shape = f"{tile['SPLIT']}x{tile['ROWS']}x{tile['CHUNK']}"
    load = re.search(rf"tt\.load .*tensor<{shape}x!tt\.ptr<\w+>, #(\w+)>", ttgir)
    if load is None:
        raise RuntimeError(f"no {shape} load in the TTGIR")
    layout = re.search(rf"#{load.group(1)} = #ttg\.blocked<\{{([^}}]*)\}}>", ttgir).group(1)
    field = {
        key: [int(v) for v in re.search(rf"{key} = \[([\d, ]+)\]", layout).group(1).split(",")]
        for key in ("sizePerThread", "threadsPerWarp", "warpsPerCTA")
    }
    tpw, wpc = field["threadsPerWarp"], field["warpsPerCTA"]
    return {
        "vector": field["sizePerThread"][2],
        "threads_per_row": tpw[2] * wpc[2],
        "row_threads_split": tpw[0] * wpc[0],  # threads on the SPLIT axis of one row: 1 if honoured
        "rows_per_program": tpw[1] * wpc[1],
    }


def compile_point(op: str, hidden: int, dtype: str, params: dict[str, int]) -> dict[str, Any]:
    """Compile one point of `op` for sm_90; registers, spills, occupancy and x's layout."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fusionlab.kernels.common import triton_tiles

    _, kernel = _kernel(op)
    ty, size = _DTYPES[dtype]
    tile = triton_tiles.tile_constexprs(params["block_size"], params["rows_per_program"],
                                        params["threads_per_row"], size)
    values = {"n_rows": ROWS, "n_cols": hidden}
    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = f"*{ty}"
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif name == "eps":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            # Triton's launcher marks integers divisible by 16; strides here are `hidden`.
            if values.get(name, hidden) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    num_warps = triton_tiles.num_warps_for(params["rows_per_program"], params["threads_per_row"])
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=tile, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    regs = _ptxas(compiled.asm["ptx"])
    shared = compiled.metadata.shared
    return {
        "op": op, "hidden": hidden, "dtype": dtype, **params, "num_warps": num_warps,
        **regs, "shared_bytes": shared, **occupancy(regs["registers"], shared, num_warps),
        "layout": _x_layout(compiled.asm["ttgir"], tile),
    }


def _compile_args(args: tuple[str, int, str, dict[str, int]]) -> dict[str, Any]:
    return compile_point(*args)


def compile_all(
    ops: tuple[str, ...] = OPS,
    hidden_sizes: tuple[int, ...] = HIDDEN_SIZES,
    dtypes: tuple[str, ...] = ("bfloat16",),
    workers: int = 2,
) -> list[dict[str, Any]]:
    """Compile every valid point of `ops` at `hidden_sizes` x `dtypes` in a pool of `workers`."""
    jobs = [
        (op, hidden, dtype, point)
        for op in ops
        for hidden in hidden_sizes
        for dtype in dtypes
        for point in valid_points(op, hidden)
    ]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_compile_args, jobs))


def markdown(results: list[dict[str, Any]]) -> str:
    """One table row per compiled point."""
    lines = [
        "| op | hidden | dtype | block | rows/prog | threads/row | warps | regs | spill B "
        "| smem B | warps/SM | occupancy | limit | layout threads/row x rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lay = r["layout"]
        lines.append(
            f"| {r['op']} | {r['hidden']} | {r['dtype']} | {r['block_size']} "
            f"| {r['rows_per_program']} | {r['threads_per_row']} | {r['num_warps']} "
            f"| {r['registers']} | {r['spill_store_bytes'] + r['spill_load_bytes']} "
            f"| {r['shared_bytes']} | {r['warps_per_sm']} | {r['occupancy']:.2f} "
            f"| {r['limited_by']} | {lay['threads_per_row']} x {lay['rows_per_program']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI: compile every point and print the results as JSON (or markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--hidden", default=",".join(map(str, HIDDEN_SIZES)))
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    results = compile_all(
        tuple(args.ops.split(",")),
        tuple(int(h) for h in args.hidden.split(",")),
        tuple(args.dtypes.split(",")),
        args.workers,
    )
    print(markdown(results) if args.markdown else json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
