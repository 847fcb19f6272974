"""Use the winners at runtime: dispatch each call to the winning variant for its key.

Winners come from an Optuna storage or from a winners file written by `fusionlab export
--format json` (results.WinnersFile), which needs no database; the decision is the tables'
(winners.py)."""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusionlab.devices import get_device
from fusionlab.errors import UserError
from fusionlab.measure.passes import FORWARD, FORWARD_BACKWARD
from fusionlab.op import key_of_first_input
from fusionlab.plan import installed_toolchain
from fusionlab.records import RANK_MODES
from fusionlab.registry import Kernel, get_op, get_variant
from fusionlab.results import Decision, WinnersFile
from fusionlab.schema import user_facing
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import DEFAULT_STORAGE, open_storage
from fusionlab.shapes import DTYPES, parse_shape
from fusionlab.toolchain import describe_difference
from fusionlab.winners import cell_winner, writes_inputs


@dataclass(frozen=True)
class Choice:
    """What a key dispatches to (`exact`, `nearest`, or `fallback`), and why when it falls back.

    decision: how sure the sweep was of the winner (`faster`, `equivalent`, `inconclusive`, ...;
    see results.Decision); None for a fallback. pass_name: the pass whose cell chose it
    (`forward`, or `forward+backward` for a training dispatcher's key that has such a cell)."""

    variant: str
    params: dict[str, Any]
    match: str
    reason: str = ""
    decision: Decision | None = None
    # the other variants that passed in the cell, fastest first: (variant, params)
    alternatives: tuple[tuple[str, dict[str, Any]], ...] = field(default=())
    pass_name: str = FORWARD


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    variant: str
    params: dict[str, Any]
    toolchain: dict[str, str]
    decision: Decision | None = None
    alternatives: tuple[tuple[str, dict[str, Any]], ...] = ()
    pass_name: str = FORWARD


@functools.cache
def _installed_toolchain(op: str, device_type: str) -> dict[str, str]:
    """The installed toolchain, read once per process (it hashes the kernels' source files)."""
    return installed_toolchain(op, device_type)


class Dispatcher:
    """Callable with the op's inputs; builds each chosen kernel once and reuses it."""

    def __init__(
        self,
        op: str,
        storage: str = DEFAULT_STORAGE,
        *,
        winners: str | None = None,
        rank_by: str = "cold",
        allow_inplace: bool = False,
        training: bool = False,
    ) -> None:
        """`allow_inplace`: also dispatch to variants that write their results into their inputs
        (as vLLM's fused_add_rms_norm does); off by default, since callers keep their inputs.
        `training`: a key with a `--pass forward+backward` cell takes that cell's winner (a
        training step runs both passes); every other key takes the forward's."""
        if rank_by not in RANK_MODES:  # bad input to the Python API
            raise ValueError(f"rank_by must be one of {', '.join(RANK_MODES)}, not {rank_by!r}")
        self.spec = get_op(op)
        self._allow_inplace = allow_inplace
        self._passes = (FORWARD_BACKWARD, FORWARD) if training else (FORWARD,)
        self._entries: dict[tuple[str, int, str], list[_Entry]] = {}
        self._training_entries: dict[tuple[str, int, str], list[_Entry]] = {}
        if winners is not None:
            self._load_winners_file(winners)
        else:
            opened = open_storage(storage, must_exist=True)
            with user_facing(f"results in {storage}"):
                cells = load_cells(opened, op)
            for cell in cells:
                if cell.cell.pass_name not in self._passes:
                    continue  # a model's forward calls run the forward's winners
                winner = cell_winner(cell, rank_by, allow_inplace=allow_inplace)
                if winner is not None:
                    others = tuple(
                        (r.variant, dict(r.params))
                        for r in cell.best_per_variant(rank_by).values()
                        if r.variant != winner.record.variant
                        and (allow_inplace or not writes_inputs(r))
                    )
                    self._add(
                        cell.cell.device_name,
                        cell.cell.threads,
                        cell.cell.dtype,
                        _Entry(
                            cell.cell.shape,
                            winner.record.variant,
                            dict(winner.record.params),
                            cell.cell.toolchain,
                            winner.decision,
                            others,
                            cell.cell.pass_name,
                        ),
                    )
        self._kernels: dict[tuple[Any, ...], Kernel] = {}
        self._choices: dict[tuple[Any, ...], Choice] = {}
        self._keyed_by_first = self.spec.key_of is key_of_first_input
        self._device_names: dict[str, str] = {}
        self._checked: set[tuple[int, str]] = set()
        self._warned: set[str] = set()

    def has_results(self) -> bool:
        """Whether the storage or winners file holds any winner of the op (any device)."""
        return bool(self._entries or self._training_entries)

    def _add(self, device_name: str, threads: int, dtype: str, entry: _Entry) -> None:
        entries = self._entries if entry.pass_name == FORWARD else self._training_entries
        entries.setdefault((device_name, threads, dtype), []).append(entry)

    def _load_winners_file(self, path: str) -> None:
        """Winners from `fusionlab export --format json`. A row names its winner by `variant`
        (its `label` is how tables show it, e.g. `cpp-inplace (in place)`); an in-place winner
        gives way to the row's best out-of-place one unless `allow_inplace`. A version 1 file
        (written before the schema had a version) is migrated as it is read; a file from a
        newer fusionlab is refused."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise UserError(
                f"winners file {path!r} is unreadable ({type(error).__name__}: {error}); "
                "write it with `fusionlab export OP --format json -o FILE`"
            ) from None
        with user_facing(repr(path)):
            winners = WinnersFile.from_dict(data)
        if winners.op != self.spec.name:
            raise UserError(f"{path!r} holds winners of {winners.op!r}, not {self.spec.name!r}")
        for row in winners.rows:
            if row.variant is None or row.params is None or row.pass_name not in self._passes:
                continue  # nothing passed in that cell, or not a pass a model runs here
            variant, params = row.variant, row.params
            others: tuple[tuple[str, dict[str, Any]], ...] = ()
            if row.inplace and not self._allow_inplace:
                if row.out_of_place is None:
                    continue  # only variants that overwrite their inputs passed
                variant, params = row.out_of_place.variant, row.out_of_place.params
            elif row.out_of_place is not None and row.out_of_place.variant != variant:
                others = ((row.out_of_place.variant, dict(row.out_of_place.params)),)
            entry = _Entry(parse_shape(row.shape), variant, dict(params), dict(row.toolchain),
                           row.decision, others, row.pass_name)
            self._add(row.device, row.threads, row.dtype, entry)

    def _check_toolchain(self, entry: _Entry, device_type: str) -> None:
        """Warn once if the entry was measured with another toolchain; each entry is compared
        once, against the toolchain installed in this process (read once)."""
        if (id(entry), device_type) in self._checked:
            return
        self._checked.add((id(entry), device_type))
        installed = _installed_toolchain(self.spec.name, device_type)
        difference = describe_difference(entry.toolchain, installed) if entry.toolchain else ""
        if difference and difference not in self._warned:
            self._warned.add(difference)
            warnings.warn(
                f"fusionlab: {self.spec.name} winners were measured with another toolchain "
                f"({difference}); run `fusionlab sweep {self.spec.name}` to refresh them",
                stacklevel=3,
            )

    def choose(self, shape: tuple[int, ...], dtype: torch.dtype, device_type: str) -> Choice:
        """Exact key first; else the op's nearest-match rule; else the op's built-in. On the CPU
        only results measured at this process's thread count are used. Decided once per key:
        a key seen before is one dictionary lookup."""
        threads = torch.get_num_threads() if device_type == "cpu" else 0
        key = (tuple(shape), dtype, device_type, threads)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = self._decide(key[0], dtype, device_type, threads)
        return choice

    def _decide(self, shape: tuple[int, ...], dtype: torch.dtype, device_type: str,
                threads: int) -> Choice:
        if device_type not in self._device_names:
            self._device_names[device_type] = get_device(device_type).hardware_name()
        device_name = self._device_names[device_type]
        dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
        trained = {e.shape: e for e in self._training_entries.get(
            (device_name, threads, dtype_name), [])}
        if shape in trained:
            entry = trained[shape]
            self._check_toolchain(entry, device_type)
            return Choice(entry.variant, dict(entry.params), "exact", decision=entry.decision,
                          alternatives=entry.alternatives, pass_name=entry.pass_name)
        entries = self._entries.get((device_name, threads, dtype_name), [])
        by_shape = {e.shape: e for e in entries}
        if shape in by_shape:
            match, entry = "exact", by_shape[shape]
        else:
            nearest = self.spec.nearest(shape, list(by_shape))
            if nearest is None:
                return Choice(
                    self.spec.builtin, {}, "fallback",
                    self._fallback_reason(device_name, threads, dtype_name),
                )
            match, entry = "nearest", by_shape[nearest]
        self._check_toolchain(entry, device_type)
        return Choice(entry.variant, dict(entry.params), match, decision=entry.decision,
                      alternatives=entry.alternatives)

    def _fallback_reason(self, device_name: str, threads: int, dtype_name: str) -> str:
        """Why nothing matched; a thread-count mismatch is said once as a warning too."""
        measured = sorted(
            {t for (name, t, dtype) in self._entries if name == device_name and dtype == dtype_name}
        )
        if not measured:
            return f"no {dtype_name} results on {device_name}"
        if threads in measured:
            return f"no {dtype_name} result matches this shape on {device_name} (op's nearest rule)"
        reason = (
            f"results on {device_name} were measured with {', '.join(map(str, measured))} "
            f"thread(s) and this process uses {threads}; sweep with --threads {threads}"
        )
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"fusionlab: {self.spec.name}: {reason}", stacklevel=3)
        return reason

    def __call__(self, *inputs: object) -> Any:
        first = inputs[0] if inputs else None
        if self._keyed_by_first and isinstance(first, torch.Tensor):
            # torch.Size hashes as the tuple it is: one lookup, no tuple copy, on the hot path
            fast = (first.shape, first.dtype, first.device.type, torch.get_num_threads())
            kernel = self._kernels.get(fast)
            if kernel is not None:
                return kernel(*inputs)
        return self._resolve(inputs)(*inputs)

    def _resolve(self, inputs: tuple[object, ...]) -> Kernel:
        """Choose and build the kernel for the inputs' key, once."""
        shape, dtype = self.spec.key_of(inputs)
        device_type = next(t.device.type for t in inputs if isinstance(t, torch.Tensor))
        key = (shape, dtype, device_type, torch.get_num_threads())
        kernel = self._kernels.get(key)
        if kernel is None:
            choice = self.choose(shape, dtype, device_type)
            variant = get_variant(self.spec.name, choice.variant)
            kernel = variant.factory(device_type, **choice.params)
            self._kernels[key] = kernel
        return kernel
