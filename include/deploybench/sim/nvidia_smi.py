"""The lab's ``nvidia-smi``: prints what NVIDIA's would for the simulated GPUs of this node.

A lab node has no GPU; its simulated engines stand for them. Each engine lists its GPU in the node's own folder
(``$DEPLOYBENCH_SIM_GPU_DIR``, set on every lab node by deploybench.lab.cluster: ``gpu-<port>.json`` naming the
engine's ``/sim/gpu`` URL, ``EngineServer.register_gpu``), and this stand-in asks each for its figures
(``EngineMetrics.smi_values``: the same closed form as the engine's DCGM gauges) and prints them as
``nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits]`` does: one line per GPU, values joined by
", ", a header of the field names with their units unless ``noheader``, the units after each value unless
``nounits``, ``[N/A]`` for a figure the GPU does not have. So the GPU sampler's nvidia-smi path
(deploybench.load.gpu, ``SMI_COMMAND``) runs for real over the run's transport on a lab whose engines export no
DCGM gauges (``--no-dcgm``, the inventory's ``sim_dcgm: false``).

What it does not know it refuses as nvidia-smi does: a field it does not have (``Field "x" is not a valid field to
query.``, exit 2), any other option (exit 2); no GPU listed, or none answering: ``No devices were found`` (exit 6);
no folder at all: the driver message (exit 9). Reads are bounded: a listing of ``MAX_GPUS`` files of at most
``MAX_ENTRY`` bytes, each answer ``MAX_ANSWER`` bytes within ``TIMEOUT_S``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

GPU_DIR_ENV = "DEPLOYBENCH_SIM_GPU_DIR"
# the fields the simulated GPU has, and the unit nvidia-smi prints after each (``nvidia-smi --help-query-gpu``;
# the header reads "utilization.gpu [%], memory.used [MiB], ..." with units, the bare names with ``nounits``)
UNITS = {"utilization.gpu": "%", "memory.used": "MiB", "memory.total": "MiB", "power.draw": "W",
         "clocks.sm": "MHz", "temperature.gpu": "", "name": "", "driver_version": ""}
TEXT_FIELDS = ("name", "driver_version")  # printed as they are (what preflight's GPU check asks, with memory.total)
MAX_GPUS = 64
MAX_ENTRY = 4096
MAX_ANSWER = 1 << 16
TIMEOUT_S = 2.0
NO_DEVICES_EXIT = 6  # nvidia-smi's "A query to find an object was unsuccessful"
NO_DRIVER_EXIT = 9  # nvidia-smi's "NVIDIA driver is not loaded"


def _parse(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(fields, header, units) from nvidia-smi's query options; ValueError for anything else."""
    fields: list[str] | None = None
    fmt: list[str] | None = None
    for arg in argv:
        if arg.startswith("--query-gpu="):
            fields = [f.strip() for f in arg.split("=", 1)[1].split(",") if f.strip()]
        elif arg.startswith("--format="):
            fmt = [f.strip() for f in arg.split("=", 1)[1].split(",")]
        else:
            raise ValueError(f"Invalid combination of input arguments ({arg[:60]!r}): this lab stand-in answers "
                             "--query-gpu=FIELDS --format=csv[,noheader][,nounits] only")
    if not fields or not fmt or fmt[0] != "csv" or not set(fmt[1:]) <= {"noheader", "nounits"}:
        raise ValueError("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
    for f in fields:
        if f not in UNITS:
            raise ValueError(f'Field "{f[:60]}" is not a valid field to query.')
    return fields, "noheader" not in fmt, "nounits" not in fmt


def _gpus(folder: Path) -> list[dict[str, float]]:
    """The figures of every listed GPU whose engine answers, in the order of their files' names."""
    out = []
    for entry in sorted(folder.glob("gpu-*.json"))[:MAX_GPUS]:
        try:
            if entry.stat().st_size > MAX_ENTRY:
                continue
            url = json.loads(entry.read_text())["url"]
            if not isinstance(url, str) or not url.startswith("http://") or not url.endswith("/sim/gpu"):
                continue
            got = json.loads(_get(url))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an engine gone (its file left behind by a crash): no GPU, as a GPU that fell off the bus
        if isinstance(got, dict):
            out.append(got)
    return out


def _get(url: str) -> bytes:
    """The body of a GET of ``url`` (``http://host:port/path``) answered 200, read within ``TIMEOUT_S`` and
    ``MAX_ANSWER`` bytes; ValueError or OSError otherwise. One HTTP/1.0 request on a socket: ``urllib.request``
    took 38 of this program's 65 ms of imports, and the GPU sampler runs it on every node at every interval."""
    hostport, _, path = url.removeprefix("http://").partition("/")
    host, _, port = hostport.rpartition(":")
    deadline = time.monotonic() + TIMEOUT_S
    with socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(f"GET /{path} HTTP/1.0\r\nHost: {hostport}\r\n\r\n".encode())
        data = b""
        while len(data) <= MAX_ANSWER + MAX_ENTRY:  # the body and its headers
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{url} answered too slowly")
            sock.settimeout(left)
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    head, sep, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or status[1] != b"200" or len(body) > MAX_ANSWER:
        raise ValueError(f"{url} answered {head[:80]!r}")
    return body


def _value(field: str, v: object, units: bool) -> str:
    """One figure as nvidia-smi prints it: power to 0.01 W ("243.17"), the others whole ("87", "61234")."""
    if field in TEXT_FIELDS:
        ok = isinstance(v, str) and 0 < len(v) <= 64 and v.isprintable() and "," not in v
        return str(v) if ok else "[N/A]"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return "[N/A]"
    text = f"{v:.2f}" if field == "power.draw" else f"{v:.0f}"
    return f"{text} {UNITS[field]}" if units and UNITS[field] else text


def main(argv: list[str]) -> int:
    try:
        fields, header, units = _parse(argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    folder = os.environ.get(GPU_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
              "latest NVIDIA driver is installed and running.", file=sys.stderr)
        return NO_DRIVER_EXIT
    gpus = _gpus(Path(folder))
    if not gpus:
        print("No devices were found")
        return NO_DEVICES_EXIT
    lines = []
    if header:
        lines.append(", ".join(f"{f} [{UNITS[f]}]" if units and UNITS[f] else f for f in fields))
    lines += [", ".join(_value(f, g.get(f), units) for f in fields) for g in gpus]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
