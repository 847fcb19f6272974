"""One captured norm call: where in the model, which op at which key, how it rounds, its time.
Below capture.py and candidates.py, which both read it."""

from __future__ import annotations

from dataclasses import dataclass

from fusionlab.shapes import format_shape


@dataclass(frozen=True)
class NormCall:
    """Calls of one norm at one key in one step: where, what, how it rounds, and its time."""

    path: str  # the module's path in the model ("" for the root)
    module_class: str
    source: str  # "module" (replaceable) or "function" (a functional call inside `path`)
    op: str
    step: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    eps: float
    casting: str
    offset: float
    calls: int  # per step
    call_us: float = 0.0  # median time of one call, timed on its own

    @property
    def key(self) -> str:
        return f"{format_shape(self.shape)} {self.dtype}"
