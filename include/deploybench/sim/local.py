"""Simulated engines as plain subprocesses on 127.0.0.1, one per "node", with no lab around them.

The load tests, the load benchmarks and the history series (``analyse.simseries``) all need
the same thing: ``n`` engines up and healthy, their endpoints, and every one of them stopped
afterwards whatever happened. ``with LocalEngines(model_dir, log_dir) as local: eps = local.start(2)``.
Health is polled with ``deploybench.http`` (which ignores proxy settings: 127.0.0.1 must
never go through one).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from deploybench.engines import sim_service_args
from deploybench.errors import DeploybenchError
from deploybench.http import is_up

if TYPE_CHECKING:
    from deploybench.config import EngineSpec
    from deploybench.load import Endpoint

MODEL = "sim-model"
START_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalEngines:
    """Start simulated engines on 127.0.0.1 (or ``host``: e.g. a netns lab's bridge address, which its load
    generators reach); ``close`` (or leaving the ``with``) stops all of them."""

    def __init__(self, model_dir: Path, log_dir: Path, *, model: str = MODEL,
                 start_timeout_s: float = START_TIMEOUT_S, host: str = "127.0.0.1"):
        self.model_dir, self.log_dir, self.model, self.host = Path(model_dir), Path(log_dir), model, host
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, n: int, *extra: str, engine: EngineSpec | None = None) -> list[Endpoint]:
        """``n`` more engines (nodes n1..n<n>, seeds 1..n), healthy before this returns; ``extra``: more
        engine options (they win over ``engine``'s). DeploybenchError when one exits or stays unhealthy."""
        from deploybench.load import Endpoint

        eps = []
        for i in range(n):
            port = free_port()
            log = self.log_dir / f"engine-{port}.log"
            argv = [sys.executable, "-m", "deploybench.sim.engine", "--host", self.host, "--port", str(port),
                    "--model-dir", str(self.model_dir), "--served-model-name", self.model, "--seed", str(i + 1),
                    "--log-level", "warning", *(sim_service_args(engine) if engine else []), *extra]
            with open(log, "wb") as fh:
                proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.procs.append(proc)
            url = f"http://{self.host}:{port}"
            self._wait_healthy(url, proc, log)
            eps.append(Endpoint(node=f"n{i + 1}", url=url, model=self.model))
        return eps

    def _wait_healthy(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DeploybenchError(f"simulated engine at {url} exited with {proc.returncode}:\n"
                                       f"{log.read_text(errors='replace')[-2000:]}")
            if is_up(f"{url}/health", timeout=1.0):
                return
            time.sleep(0.1)
        raise DeploybenchError(f"simulated engine at {url} not healthy within {self.start_timeout_s:g} s:\n"
                               f"{log.read_text(errors='replace')[-2000:]}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()

    def __enter__(self) -> LocalEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
