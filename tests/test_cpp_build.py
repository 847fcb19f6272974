"""Tests for kernels/cpp_build.py: one compile per extension per cache, whatever the number of
processes that ask for it at once, and cached loads afterwards."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusionlab.kernels import cpp_build

_UNAVAILABLE = cpp_build.unavailable_reason()

# A tiny extension: no torch headers, so it compiles in about a second; the build still goes
# through cpp_extension.load with the kernels' flags, include path and libtorch link.
SOURCE = """
#include "buildtest.h"
extern "C" double fusionlab_buildtest_scaled(double x) { return x * kFactor; }
"""
HEADER = "constexpr double kFactor = 3.0;\n"
# Loads the extension, calls its function, prints what it saw as one JSON line.
CLIENT = """
import ctypes, json, sys, torch
from pathlib import Path
from fusionlab.kernels import cpp_build
source, header = Path(sys.argv[1]), Path(sys.argv[2])
seconds = cpp_build.load("buildtest", [source], [header])
(library,) = [p for p in torch.ops.loaded_libraries if "buildtest_" in p]
scaled = ctypes.CDLL(library).fusionlab_buildtest_scaled
scaled.restype, scaled.argtypes = ctypes.c_double, [ctypes.c_double]
tag = torch.compiler.config.cache_key_tag
print(json.dumps({"seconds": seconds, "y": scaled(2.0), "library": library, "tag": tag}))
"""


def _start(source: Path, header: Path, cache: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "FUSIONLAB_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(source), str(header)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _result(process: subprocess.Popen[str]) -> dict:
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    return json.loads(stdout.splitlines()[-1])


def _compiles(cache: Path) -> list[list[str]]:
    log = cache / "builds.log"
    return [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []


def _wait_for_blocked(lock: Path, waiters: int, processes: list[subprocess.Popen[str]]) -> None:
    """Waits until `waiters` processes are blocked in flock on `lock` (from /proc/locks)."""
    st = lock.stat()
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        blocked = [line for line in Path("/proc/locks").read_text().splitlines()
                   if "->" in line and key in line]
        if len(blocked) >= waiters:
            return
        for process in processes:
            assert process.poll() is None, f"a client did not wait for the lock: {_result(process)}"
        time.sleep(0.05)
    pytest.fail(f"{waiters} clients never blocked on {lock}")


@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")
@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")
def test_concurrent_processes_compile_once_then_load(tmp_path, monkeypatch):
    source, header, cache = tmp_path / "buildtest.cpp", tmp_path / "buildtest.h", tmp_path / "c"
    source.write_text(SOURCE)
    header.write_text(HEADER)
    monkeypatch.setenv("FUSIONLAB_CACHE_DIR", str(cache))
    folder = cpp_build.build_dir("buildtest", [source], [header])
    library = folder / f"{folder.name}.so"
    # Left-overs of a build that died part way (no stamp): must be rebuilt, not loaded.
    folder.mkdir(parents=True)
    library.write_bytes(b"truncated")

    # Holding the build lock here makes the race certain: both clients must queue behind it.
    with open(folder / cpp_build.LOCK_FILE, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        clients = [_start(source, header, cache), _start(source, header, cache)]
        _wait_for_blocked(folder / cpp_build.LOCK_FILE, 2, clients)
        assert _compiles(cache) == []
    results = [_result(client) for client in clients]

    compiles = _compiles(cache)
    assert len(compiles) == 1, compiles
    name, pid, seconds = compiles[0]
    assert name == folder.name and int(pid) in (c.pid for c in clients) and float(seconds) > 0
    assert all(r["y"] == 6.0 and r["library"] == str(library) for r in results), results
    # torch.compile's cache key names this build: code compiled against another build of the
    # same op names (another schema) is never loaded from inductor's cache.
    assert all(folder.name in r["tag"].split() for r in results), results
    mtime = library.stat().st_mtime_ns

    third = _result(_start(source, header, cache))
    assert third["y"] == 6.0 and third["seconds"] > 0
    assert len(_compiles(cache)) == 1, "a cached extension was compiled again"
    assert library.stat().st_mtime_ns == mtime


@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")
def test_key_covers_sources_headers_and_cache_dir(tmp_path, monkeypatch):
    source, header = tmp_path / "a.cpp", tmp_path / "a.h"
    source.write_text(SOURCE)
    header.write_text(HEADER)
    monkeypatch.setenv("FUSIONLAB_CACHE_DIR", str(tmp_path / "one"))
    folder = cpp_build.build_dir("buildtest", [source], [header])
    assert folder.parent == tmp_path / "one" / "cpp" and folder.name.startswith("buildtest_")
    header.write_text(HEADER.replace("3.0", "4.0"))
    assert cpp_build.build_dir("buildtest", [source], [header]) != folder
    monkeypatch.delenv("FUSIONLAB_CACHE_DIR")
    assert cpp_build.cache_dir() == Path.home() / ".cache" / "fusionlab"


def test_missing_compiler_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    reason = cpp_build.unavailable_reason()
    assert reason is not None and "no-such-c++-compiler" in reason
