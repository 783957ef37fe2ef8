"""Simulated engines on 127.0.0.1 for the load benchmarks (subprocesses, stopped on exit)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from deploybench.config import EngineSpec
from deploybench.load import Endpoint
from deploybench.manifest import seed_model

MODEL = "sim-model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_engines(engine: EngineSpec, n: int) -> Iterator[list[Endpoint]]:
    procs, eps = [], []
    with tempfile.TemporaryDirectory(prefix="db-bench-") as tmp:
        seed_model(Path(tmp) / "model", total_mb=1)
        sim = engine.sim
        try:
            for i in range(n):
                port = _free_port()
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "deploybench.lab.engine", "--host", "127.0.0.1", "--port", str(port),
                     "--model-dir", str(Path(tmp) / "model"), "--served-model-name", MODEL, "--seed", str(i + 1),
                     "--max-num-seqs", str(engine.max_num_seqs), "--decode-base-ms", str(sim.decode_base_ms),
                     "--decode-per-seq-ms", str(sim.decode_per_seq_ms), "--queue-limit", str(sim.queue_limit),
                     "--prefill-per-token-ms", str(sim.prefill_per_token_ms), "--log-level", "warning"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 20
                while True:
                    try:
                        with urllib.request.urlopen(f"{url}/health", timeout=1):
                            break
                    except OSError:
                        if time.monotonic() > deadline or procs[-1].poll() is not None:
                            raise RuntimeError(f"engine at {url} did not come up") from None
                        time.sleep(0.2)
                eps.append(Endpoint(f"n{i + 1}", url, MODEL))
            yield eps
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
