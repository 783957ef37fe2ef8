"""Lab names for tests. A lab's name is global on the machine (its network namespaces, bridge and
processes carry it), so every test lab gets one nobody else uses: $DEPLOYBENCH_TEST_LAB_PREFIX (for two
checkouts testing at once) + the module's own prefix + random hex, within the 12 characters a lab name
may have. ``from tests.support import lab_names`` in every test folder."""

from __future__ import annotations

import os
import secrets


def unique(prefix: str) -> str:
    return (os.environ.get("DEPLOYBENCH_TEST_LAB_PREFIX", "") + prefix + secrets.token_hex(6))[:12]
