"""A long-lived worker process that runs trials, so a crashing or hanging variant cannot take
the sweep down. It is replaced when it dies or overruns a trial's timeout."""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol, TypeVar

from fusionlab.measure import allocator, rules
from fusionlab.records import Status

_READY_TIMEOUT_S = 300.0
R = TypeVar("R")


def _serve(
    conn: Connection, plugins: list[str], modules: list[str], log_path: str, threads: int
) -> None:
    """Worker main loop: load the same variants as the parent, then run tasks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    # The measuring modules first: they bind their clocks at import, before any plugin runs.
    import torch

    import fusionlab.measure.audit
    import fusionlab.measure.rounds
    import fusionlab.measure.trial  # noqa: F401
    from fusionlab.measure import events, integrity

    events.install()  # PEP 578: cannot be removed; sees what every plugin does from now on
    if threads:
        torch.set_num_threads(threads)
    cell_threads = torch.get_num_threads()
    from fusionlab.registry import ensure_variant_module, load_entry_points, load_plugin

    integrity.seal()  # what the measuring path uses, before any plugin could replace it
    load_entry_points()
    for path in plugins:
        load_plugin(path)
    for module in modules:
        ensure_variant_module(module)
    from fusionlab.measure.timing import clock_tampering, dispatcher_tampering

    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        result = task.run()
        # A variant replaced a clock or part of the gate, registered a kernel over an ATen op
        # the gate uses, or left torch on other threads: this process can time nothing more
        # (no honest variant is judged by it); the parent replaces it.
        retire = (clock_tampering() is not None or dispatcher_tampering() is not None
                  or events.tampered() is not None or torch.get_num_threads() != cell_threads)
        conn.send((result, retire))
        if retire:
            return


Reply = TypeVar("Reply", covariant=True)


class Task(Protocol[Reply]):
    """A unit of work for the worker: runs there, or says how it failed when the worker did."""

    def run(self) -> Reply: ...

    def failed(self, status: Status, message: str) -> Reply: ...


class TrialWorker:
    """Runs tasks in a child process with a per-task timeout."""

    def __init__(
        self,
        plugins: list[str] | None = None,
        modules: list[str] | None = None,
        threads: int = 0,
        allocator: str = "",
    ) -> None:
        """`threads`: the CPU intra-op threads every task runs with (0: torch's default);
        `allocator`: the host allocator setting it starts with (measure/allocator.py; "": the
        environment's own). Gate rules switched off (measure/rules.py) are named on stderr."""
        rules.warn_if_disabled()
        self._plugins = list(plugins or [])
        self._modules = list(modules or [])
        self._threads = threads
        self._allocator = allocator
        self._context = multiprocessing.get_context("spawn")
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        handle, self.log_path = tempfile.mkstemp(prefix="fusionlab-worker-", suffix=".log")
        os.close(handle)

    def _start(self) -> Connection:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_serve,
            args=(child, self._plugins, self._modules, self.log_path, self._threads),
            daemon=True,
        )
        # Ctrl-C is the parent's to handle. The child starts with SIGINT ignored (an ignored
        # signal stays ignored across exec, and Python then keeps it so), so a Ctrl-C during its
        # interpreter's start-up cannot kill it with a traceback; blocked meanwhile here, a
        # Ctrl-C reaches the parent once its own handler is back.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        main = threading.current_thread() is threading.main_thread()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            # Read by the new process at its start; the rules switched off are those this
            # process read at import, whatever a plugin loaded here has set since.
            with allocator.applied(self._allocator), rules.inherited():
                process.start()
        finally:
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        child.close()
        if not parent.poll(_READY_TIMEOUT_S) or parent.recv() != "ready":
            process.kill()
            raise RuntimeError(f"the worker process did not start; see {self.log_path}")
        self._process, self._conn = process, parent
        return parent

    @property
    def pid(self) -> int | None:
        """The worker process's id while one runs (a retired worker's successor has another)."""
        return self._process.pid if self._process is not None else None

    def run(self, task: Task[R], timeout_s: float) -> R:
        """Run one task; a hang becomes TIMEOUT and a dead worker CRASHED."""
        conn = self._conn or self._start()
        log_offset = Path(self.log_path).stat().st_size
        conn.send(task)
        try:
            if conn.poll(timeout_s):
                result, retire = conn.recv()
                if retire:
                    self._discard()
                return result
            status, message = Status.TIMEOUT, f"no result within {timeout_s:g} s; worker killed"
        except (EOFError, ConnectionError):
            status, message = Status.CRASHED, self._death_message()
        except KeyboardInterrupt:
            self._discard()  # the trial in flight is abandoned, not awaited
            raise
        self._discard()
        tail = self._log_tail(log_offset)
        return task.failed(status, f"{message}{'; last output: ' + tail if tail else ''}")

    def _death_message(self) -> str:
        assert self._process is not None
        self._process.join(5)
        code = self._process.exitcode
        if code is not None and code < 0:
            return f"worker process died from {signal.Signals(-code).name}"
        return f"worker process exited with code {code}"

    def _log_tail(self, offset: int) -> str:
        text = Path(self.log_path).read_text(errors="replace")[offset:]
        lines = [line for line in text.splitlines() if line.strip() and "USDT:" not in line]
        return " | ".join(lines[-3:])[-400:]

    def _discard(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def close(self) -> None:
        """Stop the worker (politely if it is idle) and remove its log."""
        if self._conn is not None and self._process is not None and self._process.is_alive():
            try:
                self._conn.send(None)
                self._process.join(5)
            except (BrokenPipeError, ConnectionError):
                pass
        self._discard()
        Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> TrialWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
