"""Start a real ``xhal-serve`` process on a free port and stop it: for tests, benchmarks and
scripts that need a live server (``with ServerProcess(["--num-kv-blocks", "8"]) as server:``)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``xhal-serve ARGS --port <free>`` as a subprocess; ``start()`` returns once ``/health``
    answers 200, and raises with the server's log as soon as it exits. ``timeout`` only bounds a
    server that neither answers nor exits: generous, since a loaded machine starts slowly."""

    def __init__(
        self,
        args: list[str],
        host: str = "127.0.0.1",
        timeout: float = 600.0,
        new_session: bool = False,
    ) -> None:
        """``new_session``: run in a process group of its own (to signal the whole group, as a
        terminal's Ctrl-C or systemd does)."""
        self.args, self.host, self.timeout, self.new_session = (
            list(args),
            host,
            timeout,
            new_session,
        )
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="xhal-serve-log-", suffix=".log")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> ServerProcess:
        """Start and wait for health; a port taken meanwhile by someone else is retried."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RuntimeError:
                if attempt == attempts - 1 or "address already in use" not in self.log():
                    raise
                self.port = free_port(self.host)
                self.url = f"http://{self.host}:{self.port}"
        raise AssertionError("unreachable")

    def _start_once(self) -> ServerProcess:
        command = [sys.executable, "-m", "serve_cli", *self.args]
        command += ["--host", self.host, "--port", str(self.port)]
        self._log.seek(0)
        self._log.truncate()
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=self.new_session
        )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"xhal-serve exited with {self.process.returncode}:\n{self.log()}"
                )
            if self._healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"xhal-serve not healthy after {self.timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the server and wait for it to exit (SIGKILL after ``timeout``)."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def metrics(self, raw: bool = False) -> dict[str, float]:
        """``GET /metrics`` parsed: ``{"xhal_kv_blocks_free": 42.0, 'name{label="x"}': 1.0}``.
        The labels every sample carries (``model_name``, ``engine``) are left out of the keys
        unless ``raw``."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=60) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name if raw else _drop_common_labels(name)] = float(value)
        return samples

    def log(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False


_COMMON_LABELS = re.compile(r'(model_name="(?:[^"\\]|\\.)*"|engine="[^"]*"),?')


def _drop_common_labels(name: str) -> str:
    """``n{model_name="m",engine="0",le="1"}`` -> ``n{le="1"}``; ``n{model_name="m"}`` -> ``n``."""
    if "{" not in name:
        return name
    base, labels = name.split("{", 1)
    labels = _COMMON_LABELS.sub("", labels[:-1]).rstrip(",")
    return f"{base}{{{labels}}}" if labels else base


def post(server: ServerProcess, path: str, body: Any, raw: bytes | None = None) -> Any:
    """One POST to ``server`` (``path`` such as "/v1/completions"): the JSON ``body``, or ``raw``
    bytes sent as JSON; its ``httpx`` response."""
    import httpx

    if raw is not None:
        headers = {"Content-Type": "application/json"}
        return httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=300)
    return httpx.post(f"{server.url}{path}", json=body, timeout=300)
