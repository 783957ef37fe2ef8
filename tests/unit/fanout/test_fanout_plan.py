"""Routing, resume planning and manifest checks of the fan-out, without a cluster."""

from __future__ import annotations

from deploybench.fanout.plan import NodeState, chain_paths, header_files, neighbour, tree_paths
from deploybench.fanout.stage import diff_manifests
from deploybench.manifest import FileEntry, Manifest

M = Manifest((FileEntry("a", 100, "1" * 64), FileEntry("b", 50, "2" * 64), FileEntry("c", 10, "3" * 64)))
ORDER = ["n01", "n02", "n03", "n04", "n05"]


def test_a_first_chain_runs_from_the_source_through_every_node_in_order():
    assert chain_paths(ORDER, {"n01"}, ORDER[1:]) == [ORDER]


def test_after_a_node_died_the_chain_restarts_from_the_node_before_the_gap():
    # n02 verified, n03 dead (not pending), n04/n05 incomplete
    assert chain_paths(ORDER, {"n01", "n02"}, ["n04", "n05"]) == [["n02", "n04", "n05"]]


def test_a_node_with_only_bad_files_is_repaired_from_its_verified_neighbour():
    paths = chain_paths(ORDER, {"n01", "n02", "n03", "n05"}, ["n04"], repair_only={"n04"})
    assert paths == [["n03", "n04"]]
    assert neighbour(ORDER, {"n01", "n05"}, "n02") == "n01"
    assert neighbour(ORDER, {"n05"}, "n02") == "n05"  # wraps round


def test_tree_rounds_double_the_holders():
    assert tree_paths(["n01"], ORDER[1:]) == [["n01", "n02"]]
    assert tree_paths(["n01", "n02"], ORDER[2:]) == [["n01", "n03"], ["n02", "n04"]]


def test_needs_and_resume_offsets():
    fresh = NodeState("n02")
    partial = NodeState("n03", staged={"a": 40, "b": "ok"})
    done = NodeState("n04", published=True)
    assert fresh.needs(M) == {"a": 0, "b": 0, "c": 0} and fresh.bytes_needed(M) == 160
    assert partial.needs(M) == {"a": 40, "c": 0} and partial.bytes_needed(M) == 70
    assert done.needs(M) == {} and done.bytes_needed(M) == 0
    # the stream starts each file at the smallest offset any receiver holds
    assert header_files(M, [partial]) == [
        {"path": "a", "size": 100, "sha256": "1" * 64, "offset": 40},
        {"path": "c", "size": 10, "sha256": "3" * 64, "offset": 0},
    ]
    assert [f["offset"] for f in header_files(M, [partial, fresh])] == [0, 0, 0]
    assert header_files(M, [done]) == []


def test_a_manifest_mismatch_names_each_file():
    other = Manifest((FileEntry("a", 100, "9" * 64), FileEntry("b", 51, "2" * 64), FileEntry("d", 1, "4" * 64)))
    lines = diff_manifests(M, other)
    assert "c: listed in the manifest (10 bytes) but missing" in lines
    assert "d: present (1 bytes) but not in the manifest" in lines
    assert "b: 51 bytes, the manifest says 50" in lines
    assert any(line.startswith("a: sha256 9999") for line in lines)


def test_a_relay_status_inspection_is_taken_only_when_it_reads_as_one():
    """The inspection a relay puts in its status replaces the controller's SSH inspect of that node; text from a
    node that does not read as an inspection leaves the node to be inspected over SSH."""
    from types import SimpleNamespace

    from deploybench.config import FanoutSpec, Policy
    from deploybench.fanout.stage import _Fanout

    f = _Fanout(SimpleNamespace(inventory=None), ORDER, "n01", "m", FanoutSpec(), Policy.ABORT, 1)  # type: ignore[arg-type]
    good = {"published": True, "bad": [], "staged": {}, "free_bytes": 123, "hashed_bytes": 0}
    told = f.states_from_status({
        "n02": {"published": True, "inspect": good},
        "n03": {"published": True},  # an older relay: no inspection
        "n04": {"inspect": {**good, "free_bytes": "plenty"}},  # not a number
        "n05": {"inspect": {"error": "refused", "paths": ["../x"]}},
    })
    assert told == {"n02"}
    assert f.states["n02"].published and f.states["n02"].free_bytes == 123
    assert set(f.states) == {"n02"}
    assert f.states_from_status({"n03": {"inspect": ["not", "a", "dict"]}}) == set()


def test_a_poll_reads_a_final_status_and_whether_its_relay_was_reaped_and_a_forged_mark_counts_for_nothing():
    """Relays._poll's answer: the status, and whether the same command saw the relay exit and removed its files
    (then _stop leaves it). The node's status file is the node's text: a status that holds the marks itself breaks
    its JSON (a failed poll) and never makes a live relay count as reaped."""
    import json

    import pytest

    from deploybench.config import FanoutSpec
    from deploybench.fanout.relay_control import FINAL, REAPED, Relays
    from deploybench.transport import CommandResult

    class Node:
        out = ""

        def run(self, cmd: str, timeout: float = 0) -> CommandResult:
            return CommandResult("n02", cmd, 0, self.out, "", 0.0)

    class FakeCluster:
        inventory = None

        def run_dir(self, n: str) -> str:
            return f"/run/{n}"

        def __getitem__(self, n: str) -> Node:
            return node

    node = Node()
    relays = Relays(FakeCluster(), "m", FanoutSpec())  # type: ignore[arg-type]

    node.out = '{"published": true}\n' + f"\n{FINAL}\n{REAPED}\n"
    assert relays._poll("n02", "r1") == {"published": True} and ("n02", "r1") in relays._reaped
    node.out = '{"published": true}' + f"\n{FINAL}\n"
    assert relays._poll("n02", "r2") == {"published": True} and ("n02", "r2") not in relays._reaped
    node.out = '{"running": true}\n'
    assert relays._poll("n02", "r3") == {"running": True} and ("n02", "r3") not in relays._reaped
    node.out = '{"published": true}\n' + f"{FINAL}\n{REAPED}" + f"\n{FINAL}\n"  # forged by the node
    with pytest.raises(json.JSONDecodeError):
        relays._poll("n02", "r4")
    assert ("n02", "r4") not in relays._reaped
