"""A `max serve` process on loopback ports, for `mokv bench serve` and the tests.

`MaxServer` starts MAX's OpenAI-compatible server on a model directory (the
`mokv max-model` command makes one), with mokv's cache (`--custom-architectures
mokv.pipelines.architecture`) or MAX's own, waits until it answers, and stops
it with everything it started (it runs in a process group of its own). While
it runs, `metrics()` reads its Prometheus endpoint and `rss_bytes()` the
resident memory of its processes.

Cache salts: the server honours the `X-Cache-Salt` header (and the
`cache_salt` request field) when started with `cache_salt=True` (MAX's
`MAX_SERVE_USE_CLIENT_CACHE_SALT`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mokv_examples.local_redis import _free_port

MOKV_ARCHITECTURE = "mokv.pipelines.architecture"
"""The module `--custom-architectures` imports for mokv's attention, kernels and manager."""


def max_executable() -> str:
    """MAX's command line (`max`) of this environment."""
    return str(Path(sys.executable).with_name("max"))


def max_environment() -> dict[str, str]:
    """The environment to start MAX's command line in, offline. MAX 26.7 starts its model
    worker with the `python3` found on PATH, not with this interpreter: the environment's
    own comes first, or the worker cannot import mokv (as when the environment is
    activated)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return dict(os.environ, PATH=path, HF_HUB_OFFLINE="1")


@dataclass(frozen=True)
class ServeOptions:
    """How one server runs: the same settings for MAX's cache and mokv's but `mokv`.

    Attributes:
        model_dir: A directory from `mokv max-model`.
        weights: The weight file in it (e.g. `model-q4_0.gguf`).
        mokv: mokv's cache and kernels (else MAX's own).
        devices: `--devices`: `cpu`, or `gpu` (MAX's Llama takes bfloat16 weights there).
        encoding: `--quantization-encoding` (None: what MAX reads from the weights).
        page_size: `--kv-cache-page-size` (MAX's own manager needs a multiple of 128).
        max_batch_size, max_length: `--max-batch-size`, `--max-length`.
        connector: `--kv-connector-config` (None: MAX's default, no tiers).
        cache_salt: Honour clients' cache salts.
        extra_args: More `max serve` arguments.
    """

    model_dir: Path
    weights: str
    mokv: bool = True
    devices: str = "cpu"
    encoding: str | None = None
    page_size: int = 128
    max_batch_size: int = 8
    max_length: int = 2048
    connector: dict[str, object] | None = None
    cache_salt: bool = True
    extra_args: tuple[str, ...] = ()

    def command(self, port: int) -> list[str]:
        """The `max serve` command line."""
        command = [max_executable(), "serve", "--devices", self.devices]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        command += ["--model-path", str(self.model_dir), "--weight-path", str(self.model_dir / self.weights)]
        if self.encoding is not None:
            command += ["--quantization-encoding", self.encoding]
        command += ["--max-batch-size", str(self.max_batch_size), "--max-length", str(self.max_length)]
        command += ["--kv-cache-page-size", str(self.page_size), "--enable-prefix-caching"]
        if self.mokv:
            command += ["--custom-architectures", MOKV_ARCHITECTURE]
        if self.connector is not None:
            command += ["--kv-connector-config", json.dumps(self.connector)]
        return command + list(self.extra_args)


@dataclass
class Metrics:
    """One scrape of the Prometheus endpoint: samples by name, each a list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 when absent)."""
        return sum(v for have, v in self.samples.get(name, []) if labels.items() <= have.items())


def parse_metrics(text: str) -> Metrics:
    """Prometheus' text format (`name{label="value",...} number`), comments skipped."""
    out = Metrics()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, number = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = {}
        for item in rest.rstrip("}").split(",") if rest else ():
            key, _, value = item.partition("=")
            labels[key.strip()] = value.strip().strip('"')
        out.samples.setdefault(name, []).append((labels, float(number)))
    return out


def _tree(pid: int) -> Iterator[int]:
    """`pid` and its descendants (Linux `/proc`)."""
    yield pid
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            yield from _tree(int(child))


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MaxServer:
    """One `max serve` process group on 127.0.0.1 (see the module docstring).

    Args:
        options: What to serve and how.
        log: File the server's output goes to (read back when it fails to start).
        env: Extra environment variables.
    """

    def __init__(self, options: ServeOptions, log: Path, env: dict[str, str] | None = None) -> None:
        self.options = options
        self.log = log
        self.env = env or {}
        self.port = _free_port()
        self.metrics_port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        """The served model's name (its path)."""
        return str(self.options.model_dir)

    def start(self, timeout_s: float = 900.0) -> MaxServer:
        """Starts the server and returns once `/health` answers (the graph is
        compiled by then, or loaded from MAX's cache).

        Raises:
            RuntimeError: The server exited or did not answer in time; the
                message holds the end of its log.
        """
        env = dict(max_environment(), MAX_SERVE_METRICS_ENDPOINT_PORT=str(self.metrics_port))
        if self.options.cache_salt:
            env["MAX_SERVE_USE_CLIENT_CACHE_SALT"] = "true"
        env.update(self.env)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.options.command(self.port), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        tail = self.log.read_text(errors="replace")[-4000:]
        self.stop()
        raise RuntimeError(f"max serve did not start on port {self.port} within {timeout_s:.0f} s:\n{tail}")

    def metrics(self) -> Metrics:
        """A scrape of the server's Prometheus endpoint. Up to 30 s: on a busy
        2-core machine (the test suite's two workers) a scrape once took over 10."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as answer:
            return parse_metrics(answer.read().decode())

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process it started."""
        assert self.process is not None
        return sum(_rss(pid) for pid in set(_tree(self.process.pid)))

    def stop(self) -> None:
        """Stops the server's process group: SIGINT, then SIGKILL after 30 s."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGINT)
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
            except ProcessLookupError:
                pass
        self.process = None

    def __enter__(self) -> MaxServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
