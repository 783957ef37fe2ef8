"""Airflow's constraints file less the packages the image's requirements pin, for ./Dockerfile's
AIRFLOW_CONSTRAINTS.

    python deploy/image_constraints.py CONSTRAINTS(URL or file) OUT REQUIREMENTS

The image installs the project's runtime set (REQUIREMENTS: requirements-extras.txt, which includes
requirements.txt with ``-r``) as it stands. Airflow's constraints for 3.3.2 pin every other package Airflow may
pull in. Where both name a package, the requirements win (pip would refuse two different pins of one package):
this leaves that line out of the constraints and prints each such package with both versions, so a person sees
where the project's set and Airflow's differ. Standard library only: it runs in the base image before anything
is installed.
"""

from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;#]+)")
_INCLUDE = re.compile(r"^\s*(?:-r|--requirement)[\s=]\s*(\S+)")


def canonical(name: str) -> str:
    """PEP 503 normalised name: case and runs of '-', '_', '.' do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """``name==version`` lines (extras and markers ignored) -> {canonical name: version}."""
    found = {}
    for line in text.splitlines():
        m = _PIN.match(line)
        if m:
            found[canonical(m.group(1))] = m.group(3)
    return found


def requirements_text(path: Path) -> str:
    """A requirements file with the files it includes (``-r NAME``, relative to it, as pip reads them)."""
    lines = []
    for line in path.read_text().splitlines():
        m = _INCLUDE.match(line)
        lines.append(requirements_text(path.parent / m.group(1)) if m else line)
    return "\n".join(lines)


def without_pinned(constraints: str, requirements: str) -> tuple[str, list[tuple[str, str, str]]]:
    """The constraints text minus the lines of packages ``requirements`` pins, and those packages as
    (name, constraint version, requirements version)."""
    ours = pins(requirements)
    kept, dropped = [], []
    for line in constraints.splitlines():
        m = _PIN.match(line)
        if m and canonical(m.group(1)) in ours:
            dropped.append((canonical(m.group(1)), m.group(3), ours[canonical(m.group(1))]))
            continue
        kept.append(line)
    return "\n".join(kept) + "\n", dropped


def read(source: str) -> str:
    if re.match(r"^https?://", source):
        with urllib.request.urlopen(source, timeout=60) as resp:  # noqa: S310 - a URL the builder chose
            return resp.read().decode()
    return Path(source).read_text()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    source, out, requirements = argv
    text, dropped = without_pinned(read(source), requirements_text(Path(requirements)))
    Path(out).write_text(text)
    differ = [d for d in dropped if d[1] != d[2]]
    print(f"constraints from {source}: {len(dropped)} packages pinned by {requirements} left out, "
          f"{len(differ)} at another version:")
    for name, theirs, ours in differ:
        print(f"  {name}: constraints {theirs}, {requirements} {ours}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
