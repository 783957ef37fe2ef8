"""What the image installs: requirements.txt less the test and development tools, and Airflow's
constraints file less the packages requirements.txt pins.

    python deploy/image_requirements.py requirements.txt OUT_REQUIREMENTS [CONSTRAINTS(URL or file) OUT]

requirements.txt is the project's own resolved and tested set, test tools included; the image leaves out
the packages only the test suite and the linters use (TEST_ONLY: pytest, the linters and type stubs, the
browser and mail test helpers, and llama-cpp-python, which compiles llama.cpp for ~14 CPU-minutes and runs
on engine nodes in tests, never in Airflow). Anything else, including a package added later, goes in.
Airflow's constraints for 3.3.2 pin every other package Airflow may pull in. Where both name a package,
requirements.txt wins (pip would refuse two different pins of one package), and this prints each such
package with both versions, so a person sees where the project's set and Airflow's differ. Used by
./Dockerfile. Standard library only: it runs in the base image before anything is installed.
"""

from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;#]+)")


# canonical names (and prefixes ending in '-') of what only tests and linters use
TEST_ONLY = ("pytest", "ruff", "mypy", "pandas-stubs", "types-", "aiosmtpd", "selenium", "llama-cpp-python", "gguf")


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


def image_requirements(requirements: str) -> tuple[str, list[str]]:
    """``requirements`` less the TEST_ONLY lines, and the names left out."""
    kept, left_out = [], []
    for line in requirements.splitlines():
        m = _PIN.match(line)
        name = canonical(m.group(1)) if m else ""
        if name and any(name == t or (t.endswith("-") and name.startswith(t)) for t in TEST_ONLY):
            left_out.append(name)
            continue
        kept.append(line)
    return "\n".join(kept) + "\n", left_out


def read(source: str) -> str:
    if re.match(r"^https?://", source):
        with urllib.request.urlopen(source, timeout=60) as resp:  # noqa: S310 - a URL the builder chose
            return resp.read().decode()
    return Path(source).read_text()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4):
        print(__doc__, file=sys.stderr)
        return 2
    requirements, out_requirements = argv[:2]
    ours, left_out = image_requirements(Path(requirements).read_text())
    Path(out_requirements).write_text(ours)
    print(f"image requirements: {requirements} less the test tools {', '.join(left_out) or '(none)'}")
    if len(argv) == 2:
        return 0
    source, out = argv[2:]
    text, dropped = without_pinned(read(source), ours)
    Path(out).write_text(text)
    differ = [d for d in dropped if d[1] != d[2]]
    print(f"constraints from {source}: {len(dropped)} packages pinned by {requirements} left out, "
          f"{len(differ)} at another version:")
    for name, theirs, ours in differ:
        print(f"  {name}: constraints {theirs}, requirements.txt {ours}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
