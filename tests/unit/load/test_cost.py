"""The cost per million output tokens of a load phase (deploybench.load.cost) from the inventory's price per
node-hour: the formula against hand-computed numbers, absent (never 0) when a price or the tokens are missing, the
inventory's refusals, and how the report, the run page and the comparison show it."""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from deploybench.analyse.pareto import cheapest_within, cost_front
from deploybench.errors import ConfigError
from deploybench.inventory import Inventory, Price
from deploybench.load import cost
from deploybench.load.results import LoadResult, SloVerdict
from deploybench.store.rows import PhaseRecord

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
BASE = {"name": "priced", "ssh": {"known_hosts": "/k"},
        "nodes": [{"name": "n1", "address": "10.0.0.1", "link_mbit": 1000},
                  {"name": "n2", "address": "10.0.0.2", "link_mbit": 1000}]}


def _result(output_tps: float, duration_s: float) -> LoadResult:
    return LoadResult(
        requests=100, errors=0, error_rate=0.0, errors_by_kind={}, achieved_rps=10.0, output_tps=output_tps,
        latency_p50_ms=50, latency_p90_ms=90, latency_p99_ms=100, latency_p999_ms=100, phase="sustained",
        offered_rps=10.0, duration_s=duration_s, warmup_s=1, started_at=T0, warmup_excluded=0, dropped_iterations=0,
        slo_ok=True, slo=SloVerdict(passed=True, reasons=[]), nodes=[], samples_path="s", warmup_samples_path=None,
        summary_path="x", k6_exit_code=0, k6_thresholds_crossed=[], k6_cpu_s=0.1, vus_pre=1, vus_max=2, tags={},
        notes=[])


# -- the formula --------------------------------------------------------------------------------------------------
def test_cost_per_million_tokens_against_hand_computed_numbers():
    # 2 nodes at 2.50 + 3.50 = 6.00 per hour for 120 s = 0.20; 48,000 tokens -> 0.20 / 48,000 x 1e6 = 4.1666...
    assert cost.per_million_tokens([2.5, 3.5], 120.0, 48_000) == pytest.approx(25 / 6, rel=1e-12)
    # the reference cluster: 16 nodes at 4.00 per hour for 10 minutes = 10.666...; 3 M tokens -> 3.5555...
    assert cost.per_million_tokens([4.0] * 16, 600.0, 3_000_000) == pytest.approx(32 / 9, rel=1e-12)
    # one node at 1.00 per hour making 1 M tokens in exactly an hour costs 1.00 per million
    assert cost.per_million_tokens([1.0], 3600.0, 1_000_000) == pytest.approx(1.0)
    assert cost.per_million_tokens([0.0, 0.0], 60.0, 1000) == 0.0  # a price of 0 is a price, not an absence


@pytest.mark.parametrize("prices, window, tokens", [([], 60.0, 1000), ([1.0], 0.0, 1000), ([1.0], 60.0, 0),
                                                     ([1.0], 60.0, float("nan")), ([1.0], float("nan"), 10)])
def test_cost_is_absent_without_nodes_window_or_tokens(prices, window, tokens):
    assert cost.per_million_tokens(prices, window, tokens) is None


def test_a_phase_gets_its_serving_nodes_cost_in_their_currency():
    res = _result(output_tps=400.0, duration_s=120.0)  # 48,000 output tokens in the window
    usd = {"n1": Price(per_node_hour=2.5, currency="USD"), "n2": Price(per_node_hour=3.5, currency="USD"),
           "n3": Price(per_node_hour=100.0, currency="USD")}  # n3 did not serve: not counted
    got = cost.attach(res, usd, ["n1", "n2"])
    assert got.cost_per_million_output_tokens == pytest.approx(4.166667, abs=1e-6)
    assert got.cost_currency == "USD" and got.cost_per_hour == 6.0
    assert got.sources["cost"].startswith("2 serving nodes at 6 USD/h")


def test_a_phase_without_a_price_or_tokens_has_no_cost_and_says_why():
    res = _result(output_tps=400.0, duration_s=120.0)
    partial = cost.attach(res, {"n1": Price(per_node_hour=2.5, currency="EUR"), "n2": None}, ["n1", "n2"])
    assert partial.cost_per_million_output_tokens is None and partial.cost_currency is None
    assert "no price per node-hour for n2" in partial.sources["cost"]
    unpriced = cost.attach(res, None, ["n1"])
    assert unpriced.cost_per_million_output_tokens is None and unpriced.sources["cost"].startswith("absent")
    silent = cost.attach(_result(output_tps=0.0, duration_s=120.0), {"n1": Price(per_node_hour=2.5, currency="EUR")},
                         ["n1"])
    assert silent.cost_per_million_output_tokens is None and "no output token" in silent.sources["cost"]
    assert silent.cost_currency == "EUR" and silent.cost_per_hour == 2.5  # the price was known, the tokens not


# -- the inventory ------------------------------------------------------------------------------------------------
def test_the_inventory_price_is_a_default_with_per_node_overrides():
    inv = Inventory.model_validate({**BASE, "price": {"per_node_hour": 2.5, "currency": "USD"},
                                    "nodes": [BASE["nodes"][0], {**BASE["nodes"][1],
                                                                 "price": {"per_node_hour": 4, "currency": "USD"}}]})
    assert inv.price_of("n1") == Price(per_node_hour=2.5, currency="USD")
    assert inv.price_of("n2") == Price(per_node_hour=4.0, currency="USD")
    assert Inventory.model_validate(BASE).price_of("n1") is None  # optional: no price, no cost
    assert Inventory.model_validate_json(inv.model_dump_json()) == inv  # what Inventory.save writes reads back


@pytest.mark.parametrize("price, named", [
    ({"per_node_hour": -1, "currency": "USD"}, "price per node-hour -1 is not a number >= 0"),
    ({"per_node_hour": "2.5", "currency": "USD"}, "price per node-hour '2.5' is not a number >= 0"),
    ({"per_node_hour": True, "currency": "USD"}, "price per node-hour True is not a number >= 0"),
    ({"per_node_hour": float("nan"), "currency": "USD"}, "price per node-hour nan is not a number >= 0"),
    ({"per_node_hour": float("inf"), "currency": "USD"}, "price per node-hour inf is not a number >= 0"),
    ({"per_node_hour": 2.5, "currency": "usd"}, "currency 'usd' is not a currency code"),
    ({"per_node_hour": 2.5, "currency": "US$"}, "currency 'US$' is not a currency code"),
    ({"per_node_hour": 2.5, "currency": 840}, "currency 840 is not a currency code"),
    ({"per_node_hour": 2.5}, "price.currency: Field required"),
    ({"per_node_hour": 2.5, "currency": "USD", "per_gpu_hour": 1}, "price.per_gpu_hour: Extra inputs"),
])
def test_a_bad_price_is_refused_naming_the_value_and_the_way_out(tmp_path, price, named):
    path = tmp_path / "priced.json"
    path.write_text(json.dumps({**BASE, "price": price}))  # NaN and Infinity as Python's json writes and reads them
    with pytest.raises(ConfigError) as exc:
        Inventory.load(path)
    assert named in str(exc.value)
    if "not a number" in named:
        assert '"per_node_hour": 2.5, "currency": "USD"' in str(exc.value)  # the way out: an example


def test_a_bad_node_price_and_mixed_currencies_are_refused():
    with pytest.raises(ValidationError, match=r"nodes\.1\.price\.per_node_hour[\s\S]*-0.5 is not a number"):
        Inventory.model_validate({**BASE, "nodes": [BASE["nodes"][0], {**BASE["nodes"][1], "price": {
            "per_node_hour": -0.5, "currency": "USD"}}]})
    with pytest.raises(ValidationError, match=r"more than one currency: USD \(price\), EUR \(node n2\)"):
        Inventory.model_validate({**BASE, "price": {"per_node_hour": 1, "currency": "USD"},
                                  "nodes": [BASE["nodes"][0], {**BASE["nodes"][1], "price": {
                                      "per_node_hour": 1, "currency": "EUR"}}]})


# -- the stored figure --------------------------------------------------------------------------------------------
def test_a_stored_cost_needs_its_currency_and_a_finite_value():
    common = dict(phase="sustained", offered_rps=10.0, achieved_rps=9.5, output_tps=1.0, requests=10, errors=0,
                  error_rate=0.0, duration_s=5.0, started_at=T0)
    assert PhaseRecord(**common, cost_per_million_output_tokens=4.17, cost_currency="USD").cost_currency == "USD"
    for bad in ({"cost_per_million_output_tokens": 4.17}, {"cost_per_million_output_tokens": math.nan,
                                                           "cost_currency": "USD"},
                {"cost_per_million_output_tokens": -1.0, "cost_currency": "USD"},
                {"cost_per_million_output_tokens": 1.0, "cost_currency": "usd"}):
        with pytest.raises(ValidationError):
            PhaseRecord(**common, **bad)


# -- the Pareto axis: cost against P99 ----------------------------------------------------------------------------
def test_cost_front_and_cheapest_at_the_latency_target():
    pts = [("a", 4.0, 900.0, "USD"), ("b", 2.0, 1500.0, "USD"), ("c", 5.0, 1000.0, "USD"),  # c: dearer and slower
           ("d", 1.0, 2500.0, "USD"), ("e", None, 100.0, None), ("f", 3.0, 800.0, "EUR")]
    assert cost_front(pts) == ["d", "b", "f", "a"]  # by cost; e unpriced; f in another currency is not compared
    assert cheapest_within(pts, 2000.0) == {"EUR": "f", "USD": "b"}  # d is cheaper but misses the 2 s target
    assert cheapest_within(pts, 850.0) == {"EUR": "f"}  # no USD configuration meets 850 ms
    assert cheapest_within(pts, 10.0) == {}


def test_report_and_run_page_show_the_cost_with_its_currency_and_absent_as_absent():
    from deploybench.web.markup import PHASE_COLUMNS, _phase_rows

    common = dict(phase="sustained", offered_rps=10.0, achieved_rps=9.5, output_tps=1.0, requests=10, errors=0,
                  error_rate=0.0, duration_s=5.0, started_at=T0)
    rows = _phase_rows([PhaseRecord(node="*", cost_per_million_output_tokens=25 / 6, cost_currency="USD", **common),
                        PhaseRecord(node="n1", **common)])
    col = PHASE_COLUMNS.index("cost per 1M output tokens")
    assert [r[col] for r in rows] == ["4.167 USD", "absent"]


def test_the_run_report_shows_each_phase_cost(tmp_path):
    from deploybench.records import LoadStageResult
    from deploybench.report.run_html import _load_sections
    from tests.support.load_records import write_load_stage

    data = write_load_stage(tmp_path / "load", "s.csv")
    data["phases"]["sustained"]["result"].update(cost_per_million_output_tokens=3.5556, cost_currency="EUR")
    html = "".join(_load_sections(LoadStageResult.model_validate(data), 2000.0))
    first = html[:html.index("</table>")]  # the phases' table
    heads = re.findall(r"<th>(.*?)</th>", first)
    rows = {cells[0]: cells for cells in (re.findall(r"<td[^>]*>(.*?)</td>", r) for r in first.split("<tr")[2:])}
    col = heads.index("cost per 1M output tokens")
    assert rows["sustained"][col] == "3.556 EUR"
    assert rows["probe"][col] == "absent"  # not priced: absent, not 0


def test_the_store_gets_the_cost_on_the_cluster_row_only():
    from deploybench.load.results import NodeFigures
    from deploybench.store.ingest import phase_records

    base = _result(output_tps=400.0, duration_s=120.0)
    node = NodeFigures(node="n1", **base.model_dump(include=set(NodeFigures.model_fields) - {"node"}))
    res = cost.attach(base.model_copy(update={"nodes": [node]}), {"n1": Price(per_node_hour=6.0, currency="USD")},
                      ["n1"])
    cluster, *nodes = phase_records(res)
    assert cluster.node == "*" and cluster.cost_currency == "USD" and [n.node for n in nodes] == ["n1"]
    assert cluster.cost_per_million_output_tokens == pytest.approx(25 / 6, abs=1e-6)
    assert all(n.cost_per_million_output_tokens is None for n in nodes)
    bare, *_ = phase_records(_result(output_tps=400.0, duration_s=120.0))  # an older record: no cost fields
    assert bare.cost_per_million_output_tokens is None and bare.cost_currency is None
