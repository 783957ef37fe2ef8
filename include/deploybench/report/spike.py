"""The spike phase in words, for the text report, the HTML report and the run page: its recovery time (or why it is
absent) and, scaling up under load, the times to the added engines serving and to the SLO holding again."""

from __future__ import annotations

from typing import Any


def _s(v: Any, absent: str) -> str:
    return f"{v:g} s" if isinstance(v, (int, float)) and not isinstance(v, bool) else f"absent ({absent})"


def facts(an: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) lines of a spike phase's analysis (deploybench.load.spike.SpikeAnalysis, as stored)."""
    p99 = an.get("peak_p99_ms")
    out = [
        ("spike", f"{an.get('base_rps', 0):.2f} -> {an.get('peak_rps', 0):.2f} req/s ({an.get('factor', 0):g} x) "
                  f"for {an.get('hold_s', 0):g} s, then {an.get('recovery_window_s', 0):g} s at the base rate"),
        ("recovery time", _s(an.get("recovery_s"), an.get("recovery_reason") or "not measured")
         + ("" if an.get("recovery_s") is None else f": {an.get('recovery_reason')}")),
        ("peak P99", "absent (no request answered)" if p99 is None else
         f"{p99:.0f} ms (before the spike {an['p99_before_ms']:.0f} ms)" if an.get("p99_before_ms") is not None
         else f"{p99:.0f} ms"),
        ("during the spike", f"{an.get('requests_spike', 0)} requests sent, {an.get('failed_spike', 0)} failed "
                             f"{an.get('errors_by_kind_spike') or ''}".rstrip()
                             + f"; {an.get('failed_recovery', 0)} failed after it"),
        ("dropped by k6", "absent (not counted)" if an.get("dropped_spike") is None else
         f"{an['dropped_spike']} in the spike, {an.get('dropped_recovery') or 0} after it"
         + (f": {an['dropped_note']}" if an.get("dropped_note") else "")),
        ("queued", (f"at most {an['in_flight_peak']} requests in flight (client)"
                    if isinstance(an.get("in_flight_peak"), int) else
                    f"requests in flight absent ({an.get('in_flight_reason') or 'not measured'})")
                   + "; engines' waiting gauge "
                   + (", ".join(f"{n} {v:g}" for n, v in sorted((an.get("waiting_peak") or {}).items())) or
                      f"absent ({an.get('waiting_reason')})")),
    ]
    up = an.get("scale_up")
    if up:
        added = "; ".join(f"{a['node']} " + (f"serving {a['serving_s']:g} s, {a.get('requests', 0)} requests"
                                            if a.get("serving_s") is not None else f"NOT serving: {a.get('error')}")
                          for a in up.get("added") or [])
        out += [("scale-up", f"{len(up.get('nodes_before') or [])} -> {len(up.get('nodes_after') or [])} engines "
                             f"({added})"),
                ("added engines serving", _s(up.get("all_serving_s"), up.get("all_serving_reason") or "")
                 + " after the spike's start"),
                ("SLO holding again", _s(up.get("slo_again_s"), up.get("slo_again_reason") or "")
                 + " after the spike's start")]
    return out


def stored_facts(recovery_s: float | None, reason: str | None, serving_s: float | None,
                 slo_s: float | None, scaled: bool) -> list[tuple[str, str]]:
    """The same from the store's cluster row of the spike phase (migration 0012_spike)."""
    out = [("recovery time", _s(recovery_s, reason or "not measured"))]
    if scaled:
        out += [("added engines serving", _s(serving_s, "not every added engine served") + " after the spike's start"),
                ("SLO holding again", _s(slo_s, "not within the phase") + " after the spike's start")]
    return out
