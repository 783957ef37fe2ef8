"""The simulated engine's CPU per request with prefix caching off and on, side by side in one run.

    .venv/bin/python bench/sim_request_cpu.py [--prompt-tokens 2000] [--requests 100] [--rounds 6]
                                              [--base PATH]

16 engines share two cores with k6 in the lab, so what the sim spends per request matters. Each engine
gets the same requests in turn, one at a time on a keep-alive connection (``max_tokens`` 1, service times
near 0: the CPU is the server's parsing, tokenizing, hashing and answering); its CPU is read from
/proc/<pid>/stat around each batch. The prompts are plain words, all different (every block a miss: the
lookup walks one block, the insert all of them). ``--base`` adds an engine run from another checkout's
``include`` (an older commit), so a change is measured against what it replaces. Prints the CPU per request
of each and their ratios; absolute figures depend on the machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploybench.manifest import seed_model

WORDS = "the of and to in is it you that he was for on are as with his they at be this have from or one had by".split()
INCLUDE = Path(__file__).resolve().parent.parent / "include"


def start(model: Path, log: Path, include: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    argv = [
        sys.executable,
        "-m",
        "deploybench.sim.engine",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--model-dir",
        str(model),
        "--max-num-seqs",
        "8",
        "--decode-base-ms",
        "0.2",
        "--decode-per-seq-ms",
        "0",
        "--prefill-per-token-ms",
        "0",
        "--max-model-len",
        "32768",
        *flags,
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            argv, env={**os.environ, "PYTHONPATH": str(include)}, stdout=subprocess.DEVNULL, stderr=err
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if m := re.search(r"ready on http://127\.0\.0\.1:(\d+)", log.read_text()):
            return proc, int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"engine {flags} did not start: {log.read_text()}")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=100, help="per engine and round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--base", type=Path, help="a checkout whose include/ runs as a third engine")
    args = ap.parse_args()
    rng = random.Random(3)
    with tempfile.TemporaryDirectory(prefix="db-bench-") as tmp:
        model = Path(tmp) / "model"
        seed_model(model, total_mb=1)
        runs = {"off": (INCLUDE, "--no-enable-prefix-caching"), "on": (INCLUDE, "--enable-prefix-caching")}
        if args.base:
            runs["base"] = (args.base / "include",)
        engines = {name: start(model, Path(tmp) / f"{name}.log", *how) for name, how in runs.items()}
        conns = {name: http.client.HTTPConnection("127.0.0.1", port) for name, (_, port) in engines.items()}
        used = dict.fromkeys(engines, 0.0)
        try:
            for _ in range(args.rounds):
                bodies = [
                    json.dumps(
                        {
                            "prompt": " ".join(rng.choice(WORDS) for _ in range(args.prompt_tokens)),
                            "max_tokens": 1,
                        }
                    )
                    for _ in range(args.requests)
                ]
                for name, (proc, _) in engines.items():
                    before = cpu_s(proc.pid)
                    for body in bodies:
                        conns[name].request("POST", "/v1/completions", body=body)
                        resp = conns[name].getresponse()
                        resp.read()
                        if resp.status != 200:
                            raise SystemExit(f"engine {name} answered {resp.status}")
                    used[name] += cpu_s(proc.pid) - before
        finally:
            for proc, _ in engines.values():
                proc.terminate()
    n = args.requests * args.rounds
    print(f"{n} requests of {args.prompt_tokens} prompt tokens per engine, CPU per request:")
    for name, seconds in used.items():
        print(f"  {name:5s} {1000 * seconds / n:.3f} ms")
    print(
        f"on/off {used['on'] / used['off']:.2f}"
        + (
            f", on/base {used['on'] / used['base']:.2f}, off/base {used['off'] / used['base']:.2f}"
            if "base" in used
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
