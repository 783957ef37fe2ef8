"""The lab's stand-ins for programs its nodes lack: ``python -I -m deploybench.sim.stand_in <program> ARGS``.

The lab puts a script per program of ``STAND_INS`` on its nodes' PATH (deploybench.lab.cluster.write_stand_ins)
that runs this. The first thing it does, before importing anything slower than the standard library, is to make
the process's command line read ``<program> ARGS``, as the real program's does: a rollout checks (every 0.5 s
while it waits) and stops only a process that still runs the command it started
(deploybench.transport ``_cmdline_test``). Then it runs the stand-in module's ``main(ARGS)``.
"""

from __future__ import annotations

import importlib
import sys

# program -> the module whose main() stands in for it
STAND_INS = {"tritonserver": "deploybench.sim.triton", "nvidia-smi": "deploybench.sim.nvidia_smi"}


def take_command_line(argv: list[str]) -> bool:
    """Make /proc/self/cmdline read ``argv``. The kernel reads the command line from the process's own argument
    area (``arg_start``..``arg_end``, fields 48-49 of /proc/self/stat): ``argv`` is written there over python's
    longer one, NUL-padded (the padding reads as trailing empty arguments, which the shell's ``$(...)`` drops).
    False when it cannot (it does not fit; no /proc)."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
        new = b"\0".join(a.encode() for a in argv) + b"\0"
        if len(new) > end - start:
            return False
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(new.ljust(end - start, b"\0"))
        return True
    except (OSError, ValueError, IndexError):
        return False


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in STAND_INS:
        print(f"deploybench.sim.stand_in: name one of {', '.join(STAND_INS)}", file=sys.stderr)
        return 2
    took = take_command_line(argv)
    module = importlib.import_module(STAND_INS[argv[0]])
    if not took:
        module.log.warning("the command line still reads python's: a rollout will not recognise this process")
    return int(module.main(argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
