"""What a result is a result *of*: five identities, each unique on a canonical hash, and a series.

Conbench's idea: results line up only when everything that changes performance is the same.
Here that is split in five parts so a report can say *which* part differs between two runs:

- **cluster** — the inventory, its nodes (name, nominal link speed, labels such as GPU model) and, where
  preflight read it, each node's fabric (the tested NIC's speed, MTU and driver, its RDMA ports and rates), so
  two fabrics never line up as one series;
- **software** — engine profile, image and version;
- **model** — the artifact: name, manifest digest, total bytes and the file manifest;
- **serving** — the engine's knobs and the number of replicas;
- **workload** — the requests (lengths, API, streaming) and the SLO they are judged by.

The **series fingerprint** hashes the five hashes and the offered load (the arrival rate,
the sustained fraction of the capacity, which phases ran): runs with the same fingerprint
are repetitions of the same thing over time, and change-point detection runs per series.
The offered load is not part of the workload, so runs of one workload at different rates
are still compared with each other (they are points of a throughput-latency curve).

Fault-injection knobs of the simulated engine (``slowdown``, ``error_rate``, ``crash_after``)
are *not* part of the serving identity: they stand in for a regression of the software,
which history must find inside one series rather than start a new series.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from deploybench.config import LATER_SIM_FIELDS, SimKnobs, canonical_hash

KINDS = ("cluster", "software", "model", "serving", "workload")
FAULT_KNOBS = ("slowdown", "error_rate", "crash_after")
# what one request is: the workload (with the SLO); a new request-shaping field belongs here
WORKLOAD_FIELDS = ("prompt_tokens", "output_tokens", "output_spread", "api", "stream", "prompt_set", "prompt_seed")
# how much load is offered: part of the series, not of the workload
LOAD_FIELDS = ("rate", "sustained_fraction", "phases", "target_url")


class Identity(BaseModel):
    """One identity row: ``attrs`` is what is hashed; ``columns`` are attrs copied to queryable columns."""

    model_config = ConfigDict(frozen=True)

    kind: str
    attrs: dict[str, Any]
    columns: dict[str, Any] = {}

    @property
    def hash(self) -> str:
        return canonical_hash({"kind": self.kind, **self.attrs})


class RunIdentity(BaseModel):
    model_config = ConfigDict(frozen=True)

    cluster: Identity
    software: Identity
    model: Identity
    serving: Identity
    workload: Identity
    load: dict[str, Any] = {}

    @property
    def fingerprint(self) -> str:
        return canonical_hash({**{k: getattr(self, k).hash for k in KINDS}, "load": self.load})

    def differences(self, other: RunIdentity) -> list[str]:
        """The kinds whose hash differs from ``other``'s, in KINDS order."""
        return [k for k in KINDS if getattr(self, k).hash != getattr(other, k).hash]


def identity_of(
    config: dict[str, Any],
    nodes: list[str],
    inventory: dict[str, Any] | None = None,
    fanout: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
    fabric: dict[str, dict[str, Any]] | None = None,
    traffic: dict[str, Any] | None = None,
) -> RunIdentity:
    """The five identities of a run from its RunConfig dump, its node names, and stage results.

    ``inventory`` is an Inventory dump (nominal link speeds and labels per node); ``fanout``
    the fanout stage result (``manifest_digest``, ``total_bytes``, ``files``); ``rollout`` the
    rollout result (``profile``, ``endpoints``, and ``image``/``version`` when a backend reports
    them); ``fabric`` node -> what preflight read of its fabric (deploybench.preflight.checks.fabric_identity).
    Missing parts leave their fields None: the hash still says what was known; a node without fabric facts
    (a run before preflight read them, or preflight skipped) keeps the identity it had. ``traffic`` is the workload
    validate resolved (``Workload.summary``: its name, its file's and data's sha256, its distributions and arrival
    process): part of the workload identity, so that runs of other traffic never line up as one series; the default
    workload (synthetic) is what every run offered before workloads had names, and keeps their identity.
    """
    inv_nodes = {n["name"]: n for n in (inventory or {}).get("nodes") or []}
    cluster_nodes = []
    for n in sorted(nodes):
        inv_node = inv_nodes.get(n) or {}
        entry = {"name": n, "link_mbit": inv_node.get("link_mbit"),
                 "labels": dict(sorted((inv_node.get("labels") or {}).items()))}
        entry.update({k: inv_node[k] for k in ("mtu", "rdma_device") if inv_node.get(k) is not None})
        if (fabric or {}).get(n):
            entry["fabric"] = dict(sorted(fabric[n].items()))  # type: ignore[index]
        cluster_nodes.append(entry)
    name = (inventory or {}).get("name") or config.get("inventory") or "?"
    cluster = Identity(kind="cluster", attrs={"name": name, "nodes": cluster_nodes},
                       columns={"name": name, "node_count": len(nodes)})

    engine = dict(config.get("engine") or {})
    rollout = rollout or {}
    profile = str(rollout.get("profile") or engine.get("profile") or "?")
    image = rollout.get("image") or engine.get("image")
    version = rollout.get("version") or engine.get("version")
    software = Identity(kind="software", attrs={"engine": profile, "image": image, "version": version},
                        columns={"engine": profile, "image": image, "version": version})

    fanout = fanout or {}
    model_name = fanout.get("model") or (config.get("model") or {}).get("name") or "?"
    files = sorted(fanout.get("files") or [], key=lambda f: str(f.get("path", "")))
    digest = fanout.get("manifest_digest")
    model = Identity(
        kind="model",
        attrs={"name": model_name, "manifest_digest": digest, "files": [] if digest else files},
        columns={"name": model_name, "manifest_digest": digest, "total_bytes": fanout.get("total_bytes"),
                 "files": files},
    )

    knobs = {k: v for k, v in engine.items() if k not in ("sim", "image", "version")}
    if not knobs.get("extra_args"):
        knobs.pop("extra_args", None)  # added later: runs without extra arguments keep their identity
    if engine.get("profile") == "sim":
        sim_default = SimKnobs().model_dump(mode="json")
        # knobs added later: runs at their default keep the identity they had before them
        knobs["sim"] = {k: v for k, v in (engine.get("sim") or {}).items()
                        if k not in FAULT_KNOBS and not (k in LATER_SIM_FIELDS and v == sim_default[k])}
    replicas = len(rollout.get("endpoints") or []) or len(nodes)
    serving = Identity(kind="serving", attrs={**knobs, "replicas": replicas})

    load_cfg = config.get("load") or {}
    requests = {k: load_cfg[k] for k in WORKLOAD_FIELDS if k in load_cfg}
    attrs: dict[str, Any] = {"requests": requests, "slo": config.get("slo") or {}}
    name = (traffic or {}).get("name") or load_cfg.get("workload") or "synthetic"
    if name != "synthetic":
        attrs["traffic"] = dict(traffic or {"name": name})
    workload = Identity(kind="workload", attrs=attrs)
    return RunIdentity(cluster=cluster, software=software, model=model, serving=serving, workload=workload,
                       load={k: load_cfg[k] for k in LOAD_FIELDS if k in load_cfg})
