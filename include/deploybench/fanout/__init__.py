"""Model fan-out: every node ends up with a verified copy of the model, published atomically.

``run`` is the stage. Strategies (``FanoutSpec.strategy``):

- ``chain`` (default): a pipelined relay over the backend network, source -> n1 -> n2 -> ...;
  each hop writes, hashes and forwards the bytes as they pass, so every node has the model in
  about one copy's time (see ``stage`` and ``deploybench.fanout.relay``);
- ``tree``: one-hop relay streams in doubling rounds;
- ``star``: rsync over SSH from the source to every node, the baseline (``star``).

Parts: ``plan`` (pure routing and resume planning), ``relay`` (the program each node runs),
``relay_control`` (the controller's side of the relay), ``stage`` (manifest, bad-input checks, rounds,
policy), ``result`` (what is reported).
"""

from __future__ import annotations

from deploybench.config import FanoutSpec, FanoutStrategy, Policy
from deploybench.fanout.result import FanoutResult, NodeCopy
from deploybench.fanout.star import checklist, manifest_script, parse_manifest_listing, rsync_argv
from deploybench.transport import Cluster

__all__ = ["run", "FanoutResult", "NodeCopy", "checklist", "manifest_script", "parse_manifest_listing", "rsync_argv"]


def run(cluster: Cluster, names: list[str], source: str, model: str, spec: FanoutSpec,
        policy: Policy = Policy.ABORT, min_nodes: int = 1) -> FanoutResult:
    """Copy ``model`` from ``source`` to every node of ``names``; a node that ends without a verified
    copy fails the stage (StageFailed, with the result) under ``abort``, or is left out under ``exclude``."""
    if spec.strategy is FanoutStrategy.STAR:
        from deploybench.fanout.star import run_star

        return run_star(cluster, names, source, model, spec, policy, min_nodes)
    from deploybench.fanout.stage import run_relay

    return run_relay(cluster, names, source, model, spec, policy, min_nodes)
