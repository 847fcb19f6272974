"""What every NKI kernel module builds around its kernel body: argument checks, availability,
the jitted kernel at an LNC degree, the device call, AWS's simulator and the NumPy model
(kernels/nki_replay.py). The module keeps the body, its exact nl / nisa names and its typed torch
op; NkiKernel does the rest the same way for each (sources: kernels/nki_common.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusionlab.kernels import nki_common, nki_replay
from fusionlab.kernels.nki_common import Plan
from fusionlab.kernels.nki_plans import Tiling

TUNABLES: dict[str, tuple[Any, ...]] = {
    "free_chunk": nki_common.FREE_CHUNKS,
    "lnc_split": nki_common.LNC_SPLITS,
}


class NkiKernel:
    """A kernel body, the module globals NKI resolves its nl / nisa in (they also hold the exact
    nl / nisa names it uses, NL_NAMES and NISA_NAMES), its tiling and its torch op's registrar.

    The body takes (*row inputs [rows, hidden], *vectors [1, hidden], eps, free_chunk,
    lnc_split), then `resident` unless the tiling is resident_only."""

    def __init__(self, body: Callable[..., Any], module_globals: dict[str, Any], tiling: Tiling,
                 register_op: Callable[[Callable[..., Any], int], Callable[..., Any]]) -> None:
        self.body, self.module_globals, self.tiling = body, module_globals, tiling
        self.register_op = register_op  # (launched kernel, lnc) -> the module's typed torch op
        self._torch_ops: dict[int, Callable[..., Any]] = {}
        self.nl_names = tuple(module_globals["NL_NAMES"])
        self.nisa_names = tuple(module_globals["NISA_NAMES"])

    def param_error(self, shape: tuple[int, ...], **params: Any) -> str | None:
        """Why these tunables cannot run at `shape` (any dtype, any generation), or None."""
        return nki_common.shape_param_error(self.tiling, TUNABLES, shape, params)

    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot run here; None when torch-neuronx, nki and a device are present."""
        return nki_common.torch_neuron_problem(self.nl_names, self.nisa_names)

    def simulator_unavailable_reason(self) -> str | None:
        """Why the kernel cannot run in AWS's simulator (it needs the real nki.simulate)."""
        return nki_common.nki_problem(self.nl_names, self.nisa_names, "simulate")

    @functools.cached_property
    def _jit(self) -> Any:
        return nki_common.bind_language(self.module_globals).jit(self.body)

    def launched(self, lnc: int) -> Callable[..., Any]:
        """The jitted kernel at LNC degree `lnc`."""
        return nki_common.launch(self._jit, lnc)

    def torch_op(self, lnc: int) -> Callable[..., Any]:
        """The kernel at LNC degree `lnc` as the module's torch op, registered on first use."""
        if lnc not in self._torch_ops:
            self._torch_ops[lnc] = self.register_op(self.launched(lnc), lnc)
        return self._torch_ops[lnc]

    def _constants(self, eps: float, plan: Plan, tunables: dict[str, Any]) -> list[Any]:
        resident = [] if self.tiling.resident_only else [plan.resident]
        return [float(eps), tunables["free_chunk"], tunables["lnc_split"], *resident]

    def on_device(self, rows: Sequence[Any], vectors: dict[str, Any], eps: float,
                  **tunables: Any) -> list[Any]:
        """Run the module's torch op on neuron tensors, eager, at the runtime's LNC degree: the
        outputs shaped like rows[0]. Rows that are not contiguous are copied by `.contiguous()`
        first, as part of the kernel's cost."""
        x = rows[0]
        for residual in rows[1:]:
            if residual.shape != x.shape or residual.dtype != x.dtype:
                raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} must match x "
                                 f"{tuple(x.shape)}/{x.dtype}")
        for name, t in vectors.items():
            if tuple(t.shape) != tuple(x.shape[-1:]):
                raise ValueError(f"{name} shape {tuple(t.shape)} != {tuple(x.shape[-1:])}")
        lnc, _ = nki_common.lnc_degree()
        plan = nki_common.shape_plan(self.tiling, tuple(x.shape), nki_common.dtype_name(x.dtype),
                                     lnc=lnc, generation=nki_common.generation(), **tunables)
        reason = self.unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        nki_common.check_devices(*rows, *vectors.values())
        outs = self.torch_op(lnc)(*(t.reshape(plan.rows, plan.hidden).contiguous() for t in rows),
                                  *(v.reshape(1, -1).contiguous() for v in vectors.values()),
                                  *self._constants(eps, plan, tunables))
        return [o.reshape(x.shape) for o in (outs if isinstance(outs, tuple) else (outs,))]

    def simulate(self, rows: Sequence[np.ndarray], vectors: Sequence[np.ndarray], eps: float, *,
                 lnc: int, **tunables: Any) -> list[np.ndarray]:
        """Run the kernel in AWS's CPU simulator, nki.simulate(kernel[lnc]), on float32 arrays:
        the outputs shaped like rows[0]."""
        shape = rows[0].shape
        plan = nki_common.shape_plan(self.tiling, shape, "float32", lnc=lnc,
                                     generation=nki_common.generation(), **tunables)
        reason = self.simulator_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        import nki

        outs = nki.simulate(self.launched(lnc))(
            *(np.ascontiguousarray(a.reshape(plan.rows, plan.hidden)) for a in rows),
            *(v.reshape(1, -1) for v in vectors), *self._constants(eps, plan, tunables))
        return [np.asarray(o).reshape(shape)
                for o in (outs if isinstance(outs, tuple | list) else (outs,))]

    def replay(self, rows: Sequence[np.ndarray], vectors: Sequence[np.ndarray], eps: float, *,
               dtype: str, lnc: int, generation: str,
               **tunables: Any) -> tuple[list[np.ndarray], nki_replay.Replay, Plan]:
        """Run the kernel's real body in the NumPy MODEL of NKI (nki_replay), not on hardware:
        the outputs shaped like rows[0], the replay and the plan."""
        shape = rows[0].shape
        plan = nki_common.shape_plan(self.tiling, shape, dtype, lnc=lnc, generation=generation,
                                     **tunables)
        result = nki_replay.replay(
            self.body,
            [*((a.reshape(plan.rows, plan.hidden), dtype) for a in rows),
             *((v.reshape(1, -1), dtype) for v in vectors)],
            self._constants(eps, plan, tunables),
            lnc=lnc, generation=generation, nl_names=self.nl_names, nisa_names=self.nisa_names)
        return [o.reshape(shape) for o in result.outputs], result, plan
