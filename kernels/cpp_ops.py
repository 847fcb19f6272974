"""The Python side of one C++ extension of torch ops: built or loaded on first use
(kernels/cpp_build.py), its fake kernels registered once (torch.compile traces the ops without a
graph break), each operator looked up once."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fusionlab.kernels import cpp_build, norm_grads

Fake = Callable[..., Any]


def fake_like(*positions: int, statistics: int = 0) -> Fake:
    """A fake kernel returning new tensors like its arguments at `positions`, then `statistics`
    fp32 row statistics of the first of them; one tensor alone is returned bare."""

    def fake(*args: Any, **kwargs: Any) -> Any:
        outputs = [norm_grads.empty_like_rows(args[i]) for i in positions]
        outputs += [norm_grads.row_statistics_like(args[positions[0]]) for _ in range(statistics)]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    return fake


def fake_inplace(*args: Any, **kwargs: Any) -> None:
    """The fake kernel of an in-place op: it returns nothing."""
    return None


_resolved: dict[str, Callable[..., Any]] = {}
"""Each operator looked up so far ("name" or "name.overload" in fusionlab's namespace)."""


def _resolve(op: str) -> Callable[..., Any]:
    name, _, overload = op.partition(".")
    found = _resolved[op] = getattr(getattr(torch.ops.fusionlab, name), overload or "default")
    return found


class CppOps:
    """The operators `fusionlab::<name>` of one extension; `needs` loads an extension it
    depends on first (its seconds counted with this one's). Loading looks up every operator
    that has a fake kernel here, so that a call traced by torch.compile finds it without a load
    (a lock dynamo cannot trace)."""

    def __init__(self, name: str, sources: Sequence[Path], headers: Sequence[Path] = (), *,
                 fakes: Mapping[str, Fake], needs: Callable[[], float] | None = None) -> None:
        self._name, self._sources, self._headers = name, tuple(sources), tuple(headers)
        self._fakes, self._needs = dict(fakes), needs
        self._faked = False

    def load(self) -> float:
        """Build (first time per cache) or load the extension, once per process; seconds spent,
        0.0 when it was already loaded."""
        seconds = 0.0 if self._needs is None else self._needs()
        seconds += cpp_build.load(self._name, self._sources, self._headers)
        if not self._faked:
            for op_name, fake in self._fakes.items():
                torch.library.register_fake(f"fusionlab::{op_name}")(fake)
                _resolve(op_name)
            self._faked = True
        return seconds

    def __getitem__(self, op: str) -> Callable[..., Any]:
        """The operator `op` ("name" or "name.overload"), the extension loaded first."""
        found = _resolved.get(op)
        if found is None:
            self.load()
            found = _resolved.get(op) or _resolve(op)
        return found
