"""Fixtures of the integration tests that need more than tests/conftest.py gives every folder: simulated
engines on 127.0.0.1 (deploybench.lab.local), for the load, history and accuracy tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from deploybench.lab.local import LocalEngines


@pytest.fixture(scope="module")
def sim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1 MB model with its manifest, which the simulated engine verifies at start-up."""
    from deploybench.manifest import seed_model

    path = tmp_path_factory.mktemp("model")
    seed_model(path, total_mb=1)
    return path


@pytest.fixture
def local_engines(sim_model_dir: Path, tmp_path: Path) -> Iterator[LocalEngines]:
    """``local_engines.start(n, *extra_args, engine=EngineSpec)`` -> [Endpoint], healthy before it returns;
    every engine started in the test is stopped after it, whatever happened. Logs in the test's tmp_path."""
    from deploybench.lab.local import LocalEngines

    with LocalEngines(sim_model_dir, tmp_path) as engines:
        yield engines
