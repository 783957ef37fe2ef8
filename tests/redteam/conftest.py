"""What the red-team tests share: a two-node inventory ``rack`` in the operator's folder (``inventory``)."""

from __future__ import annotations

import json
import sys

import pytest

from deploybench.inventory import Inventory

POLICY_ENV = "DEPLOYBENCH_POLICY"


@pytest.fixture
def inventory(tmp_path, monkeypatch):
    """A two-node inventory named ``rack`` in the operator's folder, nodes on this machine (local transport)."""
    folder = tmp_path / "inventories"
    folder.mkdir()
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "w.bin").write_bytes(b"weights")
    inv = {"name": "rack", "transport": "local", "python": sys.executable, "model_root": str(tmp_path / "models"),
           "run_root": str(tmp_path / "run"),
           "nodes": [{"name": f"n0{i}", "address": f"127.0.0.{i}", "link_mbit": 1000} for i in (1, 2)]}
    (folder / "rack.json").write_text(json.dumps(inv))
    monkeypatch.setenv("DEPLOYBENCH_INVENTORIES", str(folder))
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.delenv("DEPLOYBENCH_TARGET_URLS", raising=False)
    return Inventory.load("rack")
