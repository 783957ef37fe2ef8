"""Stand-ins for a k6-operator TestRun's runner pods and starter, run as REAL k6 processes on this machine.

No Kubernetes (and so no k6-operator) can run here. What the operator would do with an applied TestRun and its
ConfigMap is done locally, as the operator's source says (grafana/k6-operator e2c9571a): the ConfigMap's keys are
written side by side in a folder (the operator mounts them at /test), and runner i of N runs
``k6 run --quiet <segmentation.NewCommandFragments(i, N)> <spec.arguments> <folder>/<file> --address=<addr>
--paused --tag instance_id=<i> --tag testrun_name=<name>`` (pkg/resources/jobs/runner.go) with the TestRun's runner
env; once all answer on their REST API, the "starter" resumes them one after the other with the PATCH of
pkg/resources/containers/curl_start.go. Two things differ from a pod, both named here: the folder is not /test, and
the REST API listens on a loopback port, not 0.0.0.0:6565. Each runner's stdout and stderr lines go to one log, as
a container's two streams go to one pod log (whole lines of each). Every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploybench.load import k6_operator as op
from deploybench.load.runner import find_k6

START_WAIT_S = 30.0
# curl_start.go's request body
RESUME = {"data": {"attributes": {"paused": False}, "id": "default", "type": "status"}}


@dataclass
class RunnerRun:
    index: int
    exit_code: int
    log: bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runner_command(k6: str, testrun: dict[str, Any], index: int, folder: Path, address: str) -> list[str]:
    spec = testrun["spec"]
    n = int(spec["parallelism"])
    script = spec["script"]["configMap"]["file"]
    return [k6, "run", "--quiet", *op.operator_segments(index, n), *spec.get("arguments", "").split(),
            str(folder / script), f"--address={address}", "--paused", "--tag", f"instance_id={index}",
            "--tag", f"testrun_name={testrun['metadata']['name']}"]


def run_testrun(testrun: dict[str, Any], configmap: dict[str, Any], folder: Path, timeout_s: float,
                max_log: int = 64 << 20) -> list[RunnerRun]:
    """Run every runner of ``testrun`` to its end (at most ``timeout_s``); their exit codes and logs."""
    folder.mkdir(parents=True, exist_ok=True)
    for key, text in configmap["data"].items():
        (folder / key).write_text(text)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR", "LANG")}
    env.update({e["name"]: e["value"] for e in testrun["spec"]["runner"].get("env", [])})
    k6 = find_k6()
    n = int(testrun["spec"]["parallelism"])
    procs, logs, ports, readers = [], [], [], []
    try:
        for i in range(1, n + 1):
            port = _free_port()
            proc = subprocess.Popen(runner_command(k6, testrun, i, folder, f"127.0.0.1:{port}"), env=env,
                                    cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            buf = bytearray()
            lock = threading.Lock()
            # the container runtime reads a container's stdout and stderr apart and writes whole lines of each to
            # the one log file: lines of the two streams interleave, a line is never torn
            for stream in (proc.stdout, proc.stderr):
                def read(f: Any = stream, b: bytearray = buf, lk: threading.Lock = lock) -> None:
                    for line in iter(f.readline, b""):
                        with lk:
                            if len(b) < max_log:
                                b += line if line.endswith(b"\n") else line + b"\n"
                t = threading.Thread(target=read, daemon=True)
                t.start()
                readers.append(t)
            procs.append(proc)
            logs.append(buf)
            ports.append(port)
        deadline = time.monotonic() + START_WAIT_S
        for i, port in enumerate(ports):  # the operator waits until every runner's status answers
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=2) as r:
                        if r.status < 400:
                            break
                except OSError:
                    pass
                if procs[i].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"runner {i + 1} did not answer on its REST API: {bytes(logs[i])[-2000:]!r}")
                time.sleep(0.1)
        for port in ports:  # the starter: one PATCH after the other
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/status", data=json.dumps(RESUME).encode(),
                                         method="PATCH", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                assert r.status < 400
        end = time.monotonic() + timeout_s
        for p in procs:
            p.wait(timeout=max(1.0, end - time.monotonic()))
        for t in readers:
            t.join(timeout=10)
        return [RunnerRun(i + 1, p.returncode, bytes(b)) for i, (p, b) in enumerate(zip(procs, logs, strict=True))]
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
