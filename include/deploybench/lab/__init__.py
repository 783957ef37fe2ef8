"""The embedded lab: a small real cluster on this machine, and the simulated engine.

``up``/``down``/``status`` and the fault helpers live in ``deploybench.lab.cluster``;
they are re-exported here lazily, so ``python -m deploybench.lab.engine`` on a node does
not import the cluster machinery.
"""

from __future__ import annotations

from typing import Any

_CLUSTER_API = ("up", "down", "status", "set_link", "kill_node", "start_node", "load_inventory", "Mode")

__all__ = list(_CLUSTER_API)


def __getattr__(name: str) -> Any:
    if name in _CLUSTER_API:
        from deploybench.lab import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'deploybench.lab' has no attribute {name!r}")
