"""The pure parts of several load generators (deploybench.load.loadgen), the inventory's loadgens and the lab's
load-generator machines, without a lab: segments, what a generator's output may be, merging summaries."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from deploybench.errors import ConfigError, LabError
from deploybench.inventory import Inventory
from deploybench.lab.naming import NetnsNames, check_nodes
from deploybench.lab.state import LabFiles, LabState, Mode, build_inventory
from deploybench.load import loadgen
from deploybench.load.results import LoadError


def test_segments_cover_the_test_once():
    segs, seq = loadgen.segments(3)
    assert segs == ["0:1/3", "1/3:2/3", "2/3:1"] and seq == "0,1/3,2/3,1"
    assert loadgen.segments(1) == (["0:1"], "0,1")
    segs, seq = loadgen.segments(4)
    assert segs == ["0:1/4", "1/4:1/2", "1/2:3/4", "3/4:1"] and seq == "0,1/4,1/2,3/4,1"
    with pytest.raises(LoadError, match="0 load generators"):
        loadgen.segments(0)


def test_k6_argv_runs_k6_with_its_segment_inside_the_exit_code_wrapper():
    argv = loadgen.k6_argv("k6", "/run/g01/load/x", "1/3:2/3", "0,1/3,2/3,1")
    assert argv[:3] == ["sh", "-c", loadgen.WRAPPER]
    k6 = argv[argv.index("k6"):]
    assert k6[k6.index("--execution-segment") + 1] == "1/3:2/3"
    assert k6[k6.index("--execution-segment-sequence") + 1] == "0,1/3,2/3,1"
    assert k6[-1] == "/run/g01/load/x/run.js" and "json=/run/g01/load/x/k6.json.gz" in k6


def test_the_clock_offset_is_taken_against_the_round_trips_midpoint():
    sent, got = 1_700_000_000_000_000_000, 1_700_000_000_004_000_000  # a 4 ms round trip
    assert loadgen.parse_clock("1700000000002000000\n", sent, got) == (0.0, 4.0)
    off, rtt = loadgen.parse_clock("1700000000062000000", sent, got)
    assert off == pytest.approx(60.0) and rtt == pytest.approx(4.0)
    for bad in ("", "1700000000%N", "-1", "17e18", "1700000000002000000; rm -rf /"):
        with pytest.raises(ValueError, match="not epoch nanoseconds"):
            loadgen.parse_clock(bad, sent, got)


@pytest.mark.parametrize("text, want", [("running\n", ("running", None)), ("gone", ("gone", None)),
                                        ("rc 0", ("done", 0)), ("rc 99\n", ("done", 99)), ("rc 137", ("done", 137)),
                                        ("rc ", ("bad", None)), ("rc 1234", ("bad", None)), ("rc -1", ("bad", None)),
                                        ("running\nrc 0", ("bad", None)), ("", ("bad", None))])
def test_a_generators_status_is_only_what_the_script_prints(text, want):
    assert loadgen.parse_status(text) == want


def test_k6_cpu_from_the_shells_times():
    assert loadgen.parse_cpu("0m0.010s 0m0.000s\n0m1.230s 0m0.450s\n") == pytest.approx(1.68)
    assert loadgen.parse_cpu("0m0.01s 0m0.00s\n2m1.5s 0m0.5s") == pytest.approx(122.0)
    assert loadgen.parse_cpu("") is None and loadgen.parse_cpu("x\ny") is None


def test_merged_summary_sums_counts_and_keeps_a_threshold_crossed_anywhere():
    a = {"metrics": {"db_tokens_from{tokens_from:usage}": {"count": 10, "thresholds": {}},
                     "db_request{window:measure,ok:true}": {"count": 5, "thresholds": {"p(99)<2000": False}}}}
    b = {"metrics": {"db_tokens_from{tokens_from:usage}": {"count": 7},
                     "db_request{window:measure,ok:true}": {"count": 6, "thresholds": {"p(99)<2000": True}},
                     "junk": "not a metric"}}
    m = loadgen.merge_summaries({"g01": a, "g02": b})
    assert m["metrics"]["db_tokens_from{tokens_from:usage}"]["count"] == 17
    assert m["metrics"]["db_request{window:measure,ok:true}"] == {"count": 11, "thresholds": {"p(99)<2000": True}}
    assert "junk" not in m["metrics"] and set(m["generators"]) == {"g01", "g02"}


def test_the_bundle_holds_the_script_its_lib_and_the_plan(tmp_path):
    plan = tmp_path / "p.plan.json"
    plan.write_text('{"requests": []}')
    with tarfile.open(fileobj=io.BytesIO(loadgen.bundle(plan))) as tar:
        names = set(tar.getnames())
    assert {"run.js", "plan.json", "lib/config.js", "lib/metrics.js", "lib/requests.js", "lib/prompts.js"} <= names
    assert all(not n.startswith(("/", "..")) for n in names)


def test_generators_are_named_once():
    with pytest.raises(LoadError, match="named twice"):
        loadgen.Generators(cluster=None, names=["g01", "g01"])  # type: ignore[arg-type]


# -- the inventory and the lab ---------------------------------------------------------------------------------------
NODE = {"name": "n01", "address": "10.0.0.11", "link_mbit": 100}


def _inv(**more):
    return Inventory.model_validate({"name": "t", "transport": "local", "nodes": [NODE], **more})


def test_the_inventory_lists_load_generators_reached_like_nodes():
    inv = _inv(loadgens=[{"name": "g01", "address": "10.0.0.21"}, {"name": "g02", "address": "lg2.example"}])
    assert inv.loadgen_names == ["g01", "g02"] and inv.names == ["n01"]  # a generator is not a node
    assert inv.machine("g02").address == "lg2.example" and inv.machine("n01").name == "n01"
    assert inv.machine("g01").k6 == "k6"
    with pytest.raises(ConfigError, match="'g09' is neither a node nor a load generator"):
        inv.machine("g09")
    assert _inv().loadgens == []


@pytest.mark.parametrize("gen, match", [({"name": "n01", "address": "10.0.0.21"}, "appears twice or is also a node"),
                                        ({"name": "g01", "address": "-oProxyCommand=x"}, "not a host name"),
                                        ({"name": "g01", "address": "10.0.0.21", "k6": "-x"}, "may not start"),
                                        ({"name": "g01", "address": "10.0.0.21", "gpus": 1}, "Extra inputs")])
def test_a_bad_load_generator_is_refused(gen, match):
    with pytest.raises(ValueError, match=match):
        _inv(loadgens=[gen])


def test_the_labs_load_generators_follow_its_nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    state = LabState(name="t", mode=Mode.NETNS, subnet="10.200.1.0/24", node_count=2, link_mbit=100,
                     model_name="m", model_mb=1, loadgen_count=3)
    assert state.machines == ["n01", "n02", "g01", "g02", "g03"]
    assert state.index("g01") == 3 and state.address("g03") == "10.200.1.15"
    with pytest.raises(LabError, match=r"load generators g01\.\.g03"):
        state.index("g04")
    inv = build_inventory(state, LabFiles("t"))
    assert inv.names == ["n01", "n02"] and inv.loadgen_names == ["g01", "g02", "g03"]
    assert inv.machine("g02").address == "10.200.1.14"
    # older lab states (no loadgen_count) still read
    old = json.loads(state.model_dump_json())
    del old["loadgen_count"]
    assert LabState.model_validate(old).machines == ["n01", "n02"]


def test_the_labs_names_own_load_generator_namespaces_and_bound_the_count():
    names = NetnsNames.of("t")
    assert names.owns_namespace("db-t-g01") and names.owns_namespace("db-t-n01")
    assert not names.owns_namespace("db-t-x01") and not names.owns_namespace("db-tt-g01")
    check_nodes(16, 3)
    with pytest.raises(LabError, match="--loadgens 190"):
        check_nodes(16, 190)
    with pytest.raises(LabError, match="--loadgens -1"):
        check_nodes(1, -1)


def test_bundle_is_made_from_the_shipped_k6_folder():
    from deploybench.paths import k6_dir

    assert (Path(k6_dir()) / "run.js").is_file()


def test_a_generators_file_comes_back_whole_in_chunks(tmp_path, monkeypatch):
    """Real dd and base64 through the local transport: a file of several chunks (and an odd last one) arrives
    byte for byte; a missing one names the generator; a size over the bound is refused before any copy."""
    import os

    from deploybench.transport import LocalTransport

    t = LocalTransport(_inv(loadgens=[{"name": "g01", "address": "127.0.0.2"}]).machine("g01"))
    src = tmp_path / "k6.json.gz"
    src.write_bytes(os.urandom(3 * 4096 + 123))
    monkeypatch.setattr(loadgen, "FETCH_CHUNK", 4096)
    assert loadgen._fetch(t, str(src), tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    assert not loadgen._fetch(t, str(tmp_path / "none"), tmp_path / "x", required=False)
    with pytest.raises(loadgen.GeneratorFailed, match="load generator g01: .*none is missing"):
        loadgen._fetch(t, str(tmp_path / "none"), tmp_path / "x")
    monkeypatch.setattr(loadgen, "MAX_FETCH", 1000)
    with pytest.raises(loadgen.GeneratorFailed, match="holds 12411 bytes, more than"):
        loadgen._fetch(t, str(src), tmp_path / "big")
    assert not (tmp_path / "big").exists()
