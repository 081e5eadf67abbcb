"""A tiny Chrome DevTools Protocol client over ``--remote-debugging-pipe`` (stdlib only).

Chromium reads CDP commands from its fd 3 and writes replies and events to its fd 4, each
message one JSON object ended by a NUL byte. No websocket, no port, no extra package.
The browser runs in its own session (process group) so that ``close()`` can end it and
every helper process it spawned (zygote, renderer, GPU, network service).
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
# Flags this machine kind needs (see .library/env/machines/python.md): headless as root, no GPU, and no
# background connections (the closed network refuses them, many at a time).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--no-default-browser-check", "--mute-audio", "--hide-scrollbars"]


class CDPError(RuntimeError):
    pass


class Browser:
    """One headless Chromium; ``page()`` opens a tab and returns a :class:`Page`."""

    def __init__(self, user_data_dir: Path, log_path: Path, window: tuple[int, int] = (1600, 1000),
                 executable: str = CHROMIUM) -> None:
        user_data_dir.mkdir(parents=True, exist_ok=True)
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # Move the child's ends above fd 9 so that putting them on 3 and 4 cannot clobber one another.
        to_chrome_r, from_chrome_w = (_high_fd(fd) for fd in (to_chrome_r, from_chrome_w))
        args = [executable, *FLAGS, f"--user-data-dir={user_data_dir}", f"--window-size={window[0]},{window[1]}",
                "--remote-debugging-pipe", "about:blank"]
        # bash puts the two pipe ends on fds 3 and 4 before exec'ing chromium (no preexec_fn, thread-safe).
        shim = f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(["bash", "-c", shim, "chromium", *args], pass_fds=(to_chrome_r, from_chrome_w),
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._lock = threading.Lock()
        self._replies: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.events: list[dict] = []
        self._reader = threading.Thread(target=self._read_loop, name="cdp-reader", daemon=True)
        self._reader.start()
        try:
            self.version = self.call("Browser.getVersion", timeout=60)
        except BaseException:
            self.close()
            raise

    # -- transport ---------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_chrome, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cond:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                    self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30) -> dict:
        with self._lock:
            self._next_id += 1
            mid = self._next_id
            msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            data = json.dumps(msg).encode() + b"\0"
            while data:
                data = data[os.write(self._to_chrome, data):]
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._replies:
                left = deadline - time.monotonic()
                if self._closed:
                    raise CDPError(f"{method}: browser closed the pipe (exit {self.proc.poll()})")
                if left <= 0:
                    raise CDPError(f"{method}: no reply in {timeout:.0f} s")
                self._cond.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def page(self) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        p = Page(self, session)
        p.call("Page.enable")
        p.call("Runtime.enable")
        return p

    def close(self) -> None:
        """Ask the browser to quit; then end its whole process group, whatever is left."""
        try:
            if self.proc.poll() is None and not self._closed:
                self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.proc)
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        self._reader.join(timeout=5)
        self._log.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def call(self, method: str, params: dict | None = None, timeout: float = 30) -> dict:
        return self.browser.call(method, params, session=self.session, timeout=timeout)

    def goto(self, url: str) -> None:
        r = self.call("Page.navigate", {"url": url})
        if r.get("errorText"):
            raise CDPError(f"navigate {url}: {r['errorText']}")

    def eval(self, expression: str, timeout: float = 30) -> Any:
        """Value of a JS expression (promises awaited), or CDPError with the JS exception."""
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                      timeout=timeout)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise CDPError(f"JS error: {d.get('exception', {}).get('description') or d.get('text')}")
        return r.get("result", {}).get("value")

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, expression: str, timeout: float = 60, interval: float = 0.5, what: str = "") -> Any:
        """Poll a JS expression until it is truthy; its value, or CDPError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            try:
                last = self.eval(expression)
            except CDPError as e:
                last = e
            if last and not isinstance(last, CDPError):
                return last
            if time.monotonic() > deadline:
                raise CDPError(f"timed out after {timeout:.0f} s waiting for {what or expression!r} (last: {last!r})")
            time.sleep(interval)

    def wait_for_text(self, needles: list[str], timeout: float = 60) -> str:
        js = ("(() => { const t = document.body ? document.body.innerText : ''; return " + json.dumps(needles)
              + ".every(n => t.includes(n)) ? t : ''; })()")
        return self.wait_for(js, timeout=timeout, what=f"page text containing {needles}")

    def click(self, selector_js: str, what: str = "", timeout: float = 30) -> None:
        """A real mouse click (press + release) at the centre of the element ``selector_js`` evaluates to.

        ``selector_js`` is a JS expression giving an Element or null; it is waited for, scrolled into
        view, and must have a non-empty box.
        """
        js = ("(() => { const el = (" + selector_js + "); if (!el) return null;"
              " el.scrollIntoView({block: 'center', inline: 'center'});"
              " const r = el.getBoundingClientRect(); return (r.width > 0 && r.height > 0) ?"
              " [r.left + r.width / 2, r.top + r.height / 2] : null; })()")
        x, y = self.wait_for(js, timeout=timeout, what=what or selector_js)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            ev = {"type": kind, "x": x, "y": y}
            if kind != "mouseMoved":
                ev.update(button="left", clickCount=1)
            self.call("Input.dispatchMouseEvent", ev)

    def screenshot(self, path: Path, full_page: bool = False) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", params, timeout=60)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path


def _high_fd(fd: int) -> int:
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


def kill_group(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM the process group ``proc`` leads (started with start_new_session=True), then SIGKILL."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_alive(pgid):
            break
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
