"""The run layer's install (requirements.txt, what `make demo` installs) by pip and by uv, side by side.

    python3 bench/install.py [--rounds 1] [--requirements requirements.txt]

Each round creates two fresh virtual environments in a temporary folder and installs the same pinned
requirements into each, as a fresh machine would: pip with ``--no-cache-dir``, uv with ``--no-cache`` (both
download every wheel from the package index; uv with ``--compile-bytecode``, as the bootstrap runs it, so both
write the .pyc files pip writes by default). Prints each installer's wall time per round and the ratio
pip ÷ uv; .ci/bootstrap installs the run layer with uv because of it. Needs the network to the package
index (nothing else is contacted) and about 2 GB of disk in $TMPDIR.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UV_VERSION = "0.9.5"  # as .ci/bootstrap


def _timed(argv: list[str], cwd: Path) -> float:
    t0 = time.monotonic()
    res = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, timeout=1800)
    if res.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... failed:\n{res.stderr[-2000:]}")
    return time.monotonic() - t0


def one_round(requirements: Path, tmp: Path) -> dict[str, float]:
    out = {}
    for tool in ("pip", "uv"):
        venv = tmp / tool
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        if tool == "uv":  # installing uv itself counts: the bootstrap does it too
            out[tool] = _timed([py, "-m", "pip", "install", "-q", "--no-cache-dir", f"uv=={UV_VERSION}"], ROOT)
            out[tool] += _timed([str(venv / "bin" / "uv"), "pip", "install", "-q", "--no-cache", "--compile-bytecode",
                                 "--python", py, "-r", str(requirements)], ROOT)
        else:
            out[tool] = _timed([py, "-m", "pip", "install", "-q", "--no-cache-dir", "-r", str(requirements)], ROOT)
        subprocess.run(["rm", "-rf", str(venv)], check=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requirements", type=Path, default=ROOT / "requirements.txt")
    args = ap.parse_args()
    print(f"installing {args.requirements.name} into fresh virtual environments, no cache, "
          f"{args.rounds} round(s)")
    print(f"{'round':>5}  {'pip s':>7}  {'uv s':>7}  {'pip / uv':>8}")
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="deploybench-install-") as tmp:
            got = one_round(args.requirements, Path(tmp))
        print(f"{i + 1:>5}  {got['pip']:7.1f}  {got['uv']:7.1f}  {got['pip'] / got['uv']:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
