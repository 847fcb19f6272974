"""Open a page in headless Chromium (the OS package) with the network disabled and read what a
user's browser would: console errors, exceptions, failed loads, every request made, values from
the page and a screenshot. Speaks the Chrome DevTools protocol over --remote-debugging-pipe
(JSON messages separated by NUL on file descriptors 3 and 4), so it needs no extra package."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # The network is off: every host name fails to resolve and any proxied fetch hits a closed
    # port, so a page that needs the network shows it as failed loads.
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=127.0.0.1:9",
    "--window-size=1280,2000",
)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageVisit:
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, failed loads
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    values: dict[str, Any] = field(default_factory=dict)  # the expressions' results
    screenshot: bytes = b""


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.write_fd, self.read_fd = write_fd, read_fd
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == method for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {timeout_s} s")
            self.events.append(self._read())

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)


def visit(url: str, expressions: dict[str, str], timeout_s: float = 120) -> PageVisit:
    """Load `url`, let it settle, evaluate each JavaScript expression, take a screenshot."""
    binary = chromium()
    assert binary is not None, "Chromium is not installed (apt-get install chromium)"
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()

    def wire_fds() -> None:  # Chromium reads commands on fd 3 and writes replies on fd 4
        os.dup2(to_chrome_r, 3)
        os.dup2(from_chrome_w, 4)

    with tempfile.TemporaryDirectory() as profile:
        process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
             "about:blank"],
            preexec_fn=wire_fds,
            pass_fds=(3, 4),  # kept open in the child once wire_fds has placed the pipes there
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        pipe = _Pipe(to_chrome_w, from_chrome_r)
        try:
            return _visit(pipe, url, expressions, timeout_s)
        finally:
            with contextlib.suppress(RuntimeError, OSError):  # it may be gone already
                pipe.send("Browser.close")
            process.wait(timeout=30)
            os.close(to_chrome_w)
            os.close(from_chrome_r)


def _visit(pipe: _Pipe, url: str, expressions: dict[str, str], timeout_s: float) -> PageVisit:
    target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
        "sessionId"
    ]
    for domain in ("Runtime", "Log", "Network", "Page"):
        pipe.send(f"{domain}.enable", session=session)
    pipe.send("Page.navigate", {"url": url}, session=session)
    pipe.wait_for("Page.loadEventFired", timeout_s)
    time.sleep(0.5)  # late console messages and failed loads arrive as events
    result = PageVisit()
    for name, expression in expressions.items():
        reply = pipe.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
        )
        result.values[name] = reply["result"].get("value")
    shot = pipe.send(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
        session=session,
    )
    result.screenshot = base64.b64decode(shot["data"])
    for event in pipe.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            result.errors.append(" ".join(str(a.get("value")) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            result.errors.append(params["exceptionDetails"].get("text", "exception"))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            result.errors.append(params["entry"].get("text", ""))
        elif method == "Network.loadingFailed":
            result.errors.append(f"failed load: {params.get('errorText')}")
        elif method == "Network.requestWillBeSent":
            result.requests.append(params["request"]["url"])
    return result
