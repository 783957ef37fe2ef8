"""Scheduled regression benchmarks: named reference benchmarks, the software of a date, and the verdict.

A *reference benchmark* is a JSON file in ``include/benchmarks/`` (or ``$DEPLOYBENCH_BENCHMARKS_DIR``)::

    {"name": "sim_small", "schedule": "@daily", "start_date": "2026-01-01",
     "versions": "sim_engine.versions.json",
     "params": {<the trigger form's flat parameters: inventory, model, engine, serving knobs, load, SLO>},
     "metrics": ["latency_p50_ms", "output_tps"], "fail_on_suspect": false,
     "notify": [{"kind": "smtp", "to": ["perf@example.com"]}]}

(``end_date``, optional: the last date scheduled.) Its ``params`` are validated by the trigger
form's own schema (``deploybench.params.to_config``), merged with every software version. The
*versions file* maps dates to the software current from that date on (an engine image or
version, or the simulated engine's knobs such as ``sim_slowdown``)::

    {"versions": [{"since": "2026-01-01", "software": "sim 1.0", "params": {"sim_slowdown": 1.0}},
                  {"since": "2026-03-10", "software": "sim 1.1", "params": {"sim_slowdown": 1.1}}]}

so a scheduled or backfilled run for a logical date runs that date's software (``params_for``).

After the run is stored, ``judge_run`` judges it against the benchmark's earlier runs (same
benchmark file revision, ordered by logical date; ``deploybench.analyse.judge``) and writes the
verdict into the run folder and the store. ``RegressionFound`` carries the message a notifier
sends. Nothing here imports Airflow: the DAG (dags/deploybench_regression.py) reads
``schedules()`` at parse time (small local files, no database) and calls the rest from tasks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import asdict
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from deploybench import paths
from deploybench.errors import ConfigError, DeploybenchError

if TYPE_CHECKING:
    from deploybench.analyse.judge import JudgeParams

log = logging.getLogger(__name__)

ENV_DIR = "DEPLOYBENCH_BENCHMARKS_DIR"
DEFAULT_DIR = paths.PROJECT_ROOT / "include" / "benchmarks"
SUFFIX = ".benchmark.json"
DAG_PREFIX = "deploybench_regression__"
VERDICT_FILE = "verdict.json"
TAG_BENCHMARK, TAG_REVISION, TAG_SOFTWARE = "benchmark", "benchmark_rev", "software"
JudgedMetric = Literal["capacity_rps", "latency_p50_ms", "latency_p99_ms", "output_tps"]
JUDGED_METRICS: tuple[JudgedMetric, ...] = get_args(JudgedMetric)


class RegressionFound(DeploybenchError):
    """The run's verdict fails it (a regression, or a suspect with ``fail_on_suspect``); ``subject`` and
    ``text`` are what the notifiers send."""

    def __init__(self, subject: str, text: str, verdict: dict[str, Any]):
        super().__init__(f"{subject}\n{text}")
        self.subject, self.text, self.verdict = subject, text, verdict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Version(_Strict):
    since: date = Field(description="first logical date (UTC) this software was current")
    software: str = Field(min_length=1, description="a name people recognise: an image tag, a version")
    params: dict[str, Any] = Field(default_factory=dict, description="flat form parameters this software sets")


class Versions(_Strict):
    versions: list[Version] = Field(min_length=1)

    @field_validator("versions")
    @classmethod
    def _ordered(cls, v: list[Version]) -> list[Version]:
        days = [x.since for x in v]
        if days != sorted(days) or len(set(days)) != len(days):
            raise ValueError(f"versions must be listed oldest first, one per date; got since={[str(d) for d in days]}")
        return v

    def at(self, day: date) -> Version:
        """The software current on ``day``."""
        current = [v for v in self.versions if v.since <= day]
        if not current:
            raise ConfigError(f"no software version is known for {day}: the versions file starts on "
                              f"{self.versions[0].since}; add an earlier entry or backfill from that date")
        return current[-1]


NOTIFIER_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")  # module.Class, nothing else


class Notify(_Strict):
    """One notification channel: ``smtp`` (Airflow's SmtpNotifier), or ``notifier`` (any Airflow notifier
    class by import path, its message argument named by ``message_arg``)."""

    kind: Literal["smtp", "notifier"] = "smtp"
    conn_id: str | None = Field(None, description="smtp: the SMTP connection (default smtp_default)")
    to: list[str] = Field(default_factory=list)
    from_email: str | None = None
    notifier: str | None = Field(None, max_length=300, pattern=NOTIFIER_PATH.pattern,
                                 description="notifier: e.g. airflow.providers.slack.notifications.slack."
                                             "SlackNotifier (an Airflow notifier class from a module the operator's "
                                             "policy allows: deploybench.airflow.notify.notifier_class)")
    message_arg: str = Field("text", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    kwargs: dict[str, Any] = Field(default_factory=dict)


class Benchmark(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_]{0,60}$")
    description: str = ""
    schedule: str | None = Field("@daily", description="cron or preset; null: backfill and manual runs only")
    start_date: date = date(2026, 1, 1)
    end_date: date | None = Field(None, description="last date to schedule (a retired benchmark); backfills "
                                                    "stay possible up to it")
    versions: str | None = Field(None, description="the versions file, relative to the benchmark file")
    params: dict[str, Any] = Field(description="flat trigger-form parameters (deploybench.params.FIELDS)")
    metrics: list[JudgedMetric] = Field(default_factory=lambda: list(JUDGED_METRICS), min_length=1)
    fail_on_suspect: bool = False
    judge: dict[str, float] = Field(default_factory=dict, description="deploybench.analyse.judge.JudgeParams")
    notify: list[Notify] = Field(default_factory=list)
    path: Path | None = Field(None, exclude=True)

    @property
    def dag_id(self) -> str:
        return DAG_PREFIX + self.name

    @property
    def revision(self) -> str:
        """A hash of what is measured (params, metrics): runs of an edited benchmark start a new history."""
        text = json.dumps({"params": self.params, "metrics": self.metrics}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def load_versions(self) -> Versions | None:
        if not self.versions:
            return None
        path = (self.path.parent if self.path else benchmarks_dir()) / self.versions
        return Versions.model_validate(_read_json(path))

    def judge_params(self) -> JudgeParams:
        from deploybench.analyse.judge import JudgeParams

        known = set(JudgeParams.__dataclass_fields__) - {"change"}
        unknown = sorted(set(self.judge) - known)
        if unknown:
            raise ConfigError(f"benchmark {self.name!r}: unknown judge setting(s) {unknown}; allowed: {sorted(known)}")
        settings: dict[str, Any] = dict(self.judge)
        return JudgeParams(**settings)


# -- the files ------------------------------------------------------------------------------------
def benchmarks_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc


def load(path: Path | str) -> Benchmark:
    """A benchmark file, its own fields checked (``validate`` also checks its parameters)."""
    path = Path(path)
    try:
        bench = Benchmark.model_validate({**_read_json(path), "path": path})
    except ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if path.name != bench.name + SUFFIX:
        raise ConfigError(f"{path}: a benchmark named {bench.name!r} must be in {bench.name + SUFFIX}")
    return bench


def find(directory: Path | None = None) -> list[Benchmark]:
    """Every benchmark file of the directory, by name."""
    d = directory or benchmarks_dir()
    return [load(p) for p in sorted(d.glob("*" + SUFFIX))]


def by_name(name: str, directory: Path | None = None) -> Benchmark:
    d = directory or benchmarks_dir()
    path = d / (name + SUFFIX)
    if not path.is_file():
        raise ConfigError(f"no benchmark {name!r}: {path} does not exist (benchmarks: "
                          f"{', '.join(b.name for b in find(d)) or 'none'})")
    return load(path)


def schedules(directory: Path | None = None) -> list[dict[str, Any]]:
    """What the DAG file needs at parse time, per benchmark: dag_id, schedule, start/end date, description.
    Reads the small JSON files only (no database, no network); a broken file is logged and left out, so
    one bad file does not hide the other benchmarks' DAGs."""
    out = []
    for path in sorted((directory or benchmarks_dir()).glob("*" + SUFFIX)):
        try:
            b = load(path)
        except ConfigError as exc:
            log.error("benchmark file left out: %s", exc)
            continue
        out.append({"name": b.name, "dag_id": b.dag_id, "schedule": b.schedule, "start_date": b.start_date,
                    "end_date": b.end_date, "description": b.description})
    return out


def validate(bench: Benchmark) -> list[str]:
    """Check the benchmark's parameters with the trigger form's schema, with every software version
    applied; returns the software names. ConfigError names the version and the field."""
    from deploybench import params as form

    versions = bench.load_versions()
    names = []
    for v in versions.versions if versions else [None]:
        try:
            form.to_config(_merge(bench, v))
        except ConfigError as exc:
            where = f" with software {v.software!r} (since {v.since})" if v else ""
            raise ConfigError(f"benchmark {bench.name!r}{where}: {exc}") from exc
        names.append(v.software if v else "")
    return names


def _merge(bench: Benchmark, version: Version | None) -> dict[str, Any]:
    flat = {**bench.params, **(version.params if version else {})}
    tags = {**(flat.get("tags") or {}), TAG_BENCHMARK: bench.name, TAG_REVISION: bench.revision}
    if version:
        tags[TAG_SOFTWARE] = version.software
    flat["tags"] = tags
    return flat


def day_of(logical_date: datetime | str | None) -> date:
    """The UTC day a logical date stands for (a manual run without one: today, UTC)."""
    if logical_date is None or logical_date == "":
        return datetime.now(UTC).date()
    if isinstance(logical_date, str):
        logical_date = datetime.fromisoformat(logical_date)
    return (logical_date.astimezone(UTC) if logical_date.tzinfo else logical_date).date()


def params_for(bench: Benchmark, logical_date: datetime | str | None) -> dict[str, Any]:
    """The flat parameters of the benchmark's run for ``logical_date``: the benchmark's, with the software
    current on that day, tagged with the benchmark, its revision and the software (checked by to_config)."""
    from deploybench import params as form

    versions = bench.load_versions()
    version = versions.at(day_of(logical_date)) if versions else None
    flat = _merge(bench, version)
    form.to_config(flat)  # fail here, naming the benchmark, rather than in validate
    log.info("benchmark %s for %s: software %s", bench.name, logical_date, version.software if version else "-")
    return flat


# -- the verdict ----------------------------------------------------------------------------------
def report_url(base_url: str | None, run_key: str) -> str:
    """The run's report in the results pages (the Airflow plugin at /deploybench)."""
    return f"{(base_url or '').rstrip('/')}/deploybench/runs/{quote(run_key, safe='')}/report"


def judge_run(bench: Benchmark, run_key: str, dsn: str | None = None, base_url: str | None = None) -> dict[str, Any]:
    """Judge a stored run against the benchmark's earlier runs (same revision, logical date up to its own).

    Writes ``verdict.json`` into the run folder and one Verdict row per metric (method
    ``deploybench-judge``); raises RegressionFound when the verdict fails the run. A run that did not
    succeed is not judged (its failure fails the DAG run anyway)."""
    import numpy as np
    import pandas as pd

    from deploybench.analyse.figures import run_figures
    from deploybench.analyse.judge import METHOD, judge_newest
    from deploybench.store.db import open_store
    from deploybench.store.query import EmptySelection, RunFilter, select_runs

    engine = open_store(dsn)
    this = select_runs(engine, RunFilter(run_keys=(run_key,)))
    row = this.iloc[0]
    out: dict[str, Any] = {"benchmark": bench.name, "run_key": run_key, "report_url": report_url(base_url, run_key),
                           "software": (row["tags"] or {}).get(TAG_SOFTWARE), "logical_date": _iso(row["order_at"])}
    if row["status"] != "success":
        out.update(verdict="not judged", reason=f"the run's status is {row['status']}")
        _write_verdict(run_key, out)
        return out
    try:  # the benchmark's successful, not excluded runs of this revision
        runs = select_runs(engine, RunFilter(tags={TAG_BENCHMARK: bench.name, TAG_REVISION: bench.revision}))
    except EmptySelection:
        runs = this.iloc[0:0]
    before = runs[(runs["order_at"] < row["order_at"]) & (runs["run_key"] != run_key)]
    runs = pd.concat([before, this], ignore_index=True)  # the judged run last, whatever its tags say
    figs = run_figures(engine, runs)
    params = bench.judge_params()
    keys = list(figs["run_key"])
    verdicts: dict[str, dict[str, Any]] = {}
    for metric in bench.metrics:
        values = figs[metric].to_numpy(dtype=float)
        if not len(values) or not np.isfinite(values[-1]):  # the run has no such figure (no probe phase...)
            continue
        keep = np.isfinite(values)
        kept_keys = [k for k, ok in zip(keys, keep) if ok]
        j = judge_newest(metric, values[keep], params)
        verdicts[metric] = {**j.to_dict(), "against": [kept_keys[i] for i in j.against],
                            "change_at": kept_keys[j.change_at] if j.change_at is not None else None}
    worst = _overall(verdicts)
    out.update(verdict=worst, metrics=verdicts, runs=len(keys), method=METHOD, params=asdict(params))
    _write_verdict(run_key, out)
    series_id = row["series_id"]
    _save(engine, run_key, None if series_id is None or series_id != series_id else int(series_id), verdicts, params)
    failing = [m for m, v in verdicts.items() if v["verdict"] == "regression"
               or (bench.fail_on_suspect and v["verdict"] == "suspect" and v["direction"] == "worse")]
    log.info("benchmark %s run %s: %s", bench.name, run_key, describe(out))
    if failing:
        subject, text = message(bench, out, failing)
        raise RegressionFound(subject, text, out)
    return out


def _iso(value: Any) -> str | None:
    return value.isoformat() if hasattr(value, "isoformat") else (str(value) if value is not None else None)


def _overall(verdicts: dict[str, dict[str, Any]]) -> str:
    order = ("regression", "suspect", "improvement", "no change")
    found = [v["verdict"] for v in verdicts.values()]
    return next((o for o in order if o in found), "no change")


def _write_verdict(run_key: str, data: dict[str, Any]) -> None:
    d = paths.run_dir(run_key)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (VERDICT_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(d / VERDICT_FILE)


def read_verdict(run_key: str) -> dict[str, Any] | None:
    p = paths.run_dir(run_key) / VERDICT_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def _save(engine: Any, run_key: str, series_id: int | None, verdicts: dict[str, dict[str, Any]], params: Any) -> None:
    """Upsert one Verdict row per metric (method deploybench-judge): a re-judged run replaces its rows."""
    if series_id is None:
        return
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    from deploybench.analyse.judge import METHOD
    from deploybench.store.models import Verdict

    with engine.begin() as conn:
        for metric, v in verdicts.items():
            stmt = pg_insert(Verdict).values(
                series_id=series_id, run_key=run_key, metric=metric, method=METHOD,
                params={**asdict(params), "against": v["against"], "how": v["how"], "change_at": v["change_at"]},
                verdict=v["verdict"], magnitude=v["magnitude"], p_value=v["p_value"])
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[Verdict.run_key, Verdict.metric, Verdict.method],
                set_={k: stmt.excluded[k] for k in ("params", "verdict", "magnitude", "p_value", "series_id")}))


def describe(verdict: dict[str, Any]) -> str:
    """One line: the overall verdict and each metric's."""
    parts = [f"{m} {v['verdict']} ({v['magnitude']:+.1%}" + (f", p={v['p_value']:.2g}" if v.get("p_value") is not None
                                                                else "") + ")"
             for m, v in (verdict.get("metrics") or {}).items()]
    return f"{verdict.get('verdict')}: " + "; ".join(parts) if parts else str(verdict.get("verdict"))


def message(bench: Benchmark, verdict: dict[str, Any], failing: list[str]) -> tuple[str, str]:
    """The notification: a subject naming the benchmark, the metric and the magnitude, and a text with the
    p-value, what it was judged against, the software and the report's link."""
    first = verdict["metrics"][failing[0]]
    subject = (f"[deploybench] {first['verdict']} in benchmark {bench.name}: {failing[0]} "
               f"{first['magnitude']:+.1%}" + (f" (+{len(failing) - 1} more)" if len(failing) > 1 else ""))
    lines = [f"Benchmark {bench.name} ({bench.description or 'reference benchmark'}), run {verdict['run_key']}",
             f"logical date {verdict.get('logical_date')}, software {verdict.get('software') or 'unchanged'}", ""]
    for m in failing:
        v = verdict["metrics"][m]
        p = f"p = {v['p_value']:.2g}" if v.get("p_value") is not None else "p = n/a"
        lines.append(f"{m}: {v['verdict']}, {v['magnitude']:+.1%} ({v['value']:.4g} against a level of "
                     f"{v['level']:.4g}; {p}; {v['how']}; judged against {len(v['against'])} runs: "
                     f"{', '.join(v['against'][-5:])}{' ...' if len(v['against']) > 5 else ''})")
    lines += ["", f"Report: {verdict['report_url']}"]
    return subject, "\n".join(lines)

