"""Per-request samples: parsing k6's ``--out json`` points, and the samples files of a run's folder.

A samples DataFrame has the results store's columns (``SAMPLE_COLUMNS``) and, in memory only, a few
more: ``warmup`` (started in the warm-up), ``lag_ms`` (k6's schedule lag; NaN for the sampler's rows),
``iteration`` (k6's rows: its iteration index in the whole test, unique across load generators; NaN elsewhere),
``generator`` (the load generator that sent it, when several split the phase: deploybench.load.loadgen),
``itl_ms`` (the sampler's inter-token gaps, a list per row) and ``end`` (when the answer was complete).
The files hold exactly ``SAMPLE_COLUMNS`` so that ``deploybench.store`` takes them as they are.
Rows with ``ttft_ms`` set come from the client-side SSE sampler (``ttft.py``), the others from k6.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Literal

import pandas as pd

from deploybench.load.results import LoadError

SAMPLE_METRIC = "db_request"
# the columns of a samples file; the same as the results store's sample table
SAMPLE_COLUMNS = [
    "ts", "phase", "node", "status", "error_kind", "latency_ms", "ttft_ms", "prompt_tokens", "output_tokens",
]
EXTRA_COLUMNS = ["warmup", "lag_ms", "itl_ms", "turn"]


MAX_K6_LINE = 1 << 20  # characters of one line of k6's JSON output: a Point is a few hundred
MAX_K6_LINES = 50_000_000  # lines read of one output: past it, not a k6 run deploybench started (a load generator's
# file is a remote machine's output: hostile input, however it was fetched)


def _finite(v: object) -> float:
    f = float(v)  # type: ignore[arg-type]
    if not math.isfinite(f):
        raise ValueError(f"not a finite number: {v!r}")
    return f


def read_k6_json(path: Path) -> tuple[pd.DataFrame, list[pd.Timestamp]]:
    """Parse k6's ``--out json`` file: (samples, times of dropped iterations: k6's own, of the arrival-rate
    executors, and run.js's ``db_dropped``, of a timed plan's requests no VU was free for).

    The samples have SAMPLE_COLUMNS plus ``warmup`` (bool: the request started in the warm-up),
    ``lag_ms`` and ``itl_ms`` (empty: k6 cannot see tokens). Read as hostile input (a load generator's output comes
    from another machine): lines up to ``MAX_K6_LINE``, at most ``MAX_K6_LINES``, finite numbers, string tags."""
    rows, dropped = [], []
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for n in range(MAX_K6_LINES + 1):
                line = fh.readline(MAX_K6_LINE + 1)
                if not line:
                    break
                if n == MAX_K6_LINES or (len(line) > MAX_K6_LINE and not line.endswith("\n")):
                    raise ValueError(f"line {n + 1} longer than {MAX_K6_LINE} characters, or more than "
                                     f"{MAX_K6_LINES} lines")
                if '"type":"Point"' not in line:
                    continue
                if f'"metric":"{SAMPLE_METRIC}"' in line:
                    data = json.loads(line)["data"]
                    tags, md = data["tags"], data.get("metadata") or {}
                    if not isinstance(tags, dict) or not isinstance(md, dict) or not isinstance(tags["node"], str):
                        raise ValueError(f"line {n + 1}: tags and metadata are not what k6 writes")
                    rows.append({
                        "ts": int(md["t0"]),
                        "phase": str(tags.get("phase", "")),
                        "node": tags["node"],
                        "status": int(tags.get("status") or 0),
                        "error_kind": str(tags["error_kind"]) if tags.get("error_kind") else None,
                        "latency_ms": _finite(data["value"]),
                        "ttft_ms": None,
                        "prompt_tokens": int(md.get("prompt_tokens", 0)),
                        "output_tokens": int(md.get("output_tokens", 0)),
                        "warmup": tags.get("window") == "warmup",
                        "lag_ms": _finite(md["lag_ms"]) if "lag_ms" in md else None,
                        "itl_ms": None,
                        # a conversation's turn (0 first); None outside a conversation workload's plan
                        "turn": int(md["turn"]) if "turn" in md else None,
                        # k6's iteration index in the whole test (segment-aware: unique across generators)
                        "iteration": int(md["iter"]) if "iter" in md else None,
                    })
                elif '"metric":"dropped_iterations"' in line or '"metric":"db_dropped"' in line:
                    dropped.append(pd.Timestamp(json.loads(line)["data"]["time"]))
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise LoadError(f"{path}: cannot read k6's JSON output ({exc!r}); see the k6 log beside it") from exc
    df = pd.DataFrame(rows, columns=[*SAMPLE_COLUMNS, *EXTRA_COLUMNS, "iteration"])
    df["iteration"] = pd.to_numeric(df["iteration"], errors="coerce").astype("float64")
    return _typed(df, ts_unit="ms"), dropped


def _typed(df: pd.DataFrame, ts_unit: Literal["s", "ms", "us", "ns"] | None = None) -> pd.DataFrame:
    out = df.copy()
    if ts_unit:
        out["ts"] = pd.to_datetime(out["ts"], unit=ts_unit, utc=True)
    else:
        out["ts"] = pd.to_datetime(out["ts"], utc=True, format="ISO8601")
    out["status"] = out["status"].astype("int64")
    out["latency_ms"] = out["latency_ms"].astype("float64")
    out["ttft_ms"] = pd.to_numeric(out["ttft_ms"], errors="coerce").astype("float64")
    out["prompt_tokens"] = out["prompt_tokens"].astype("int64")
    out["output_tokens"] = out["output_tokens"].astype("int64")
    if "warmup" in out:
        out["warmup"] = out["warmup"].astype(bool)
    if "lag_ms" in out:
        out["lag_ms"] = pd.to_numeric(out["lag_ms"], errors="coerce").astype("float64")
    if "turn" in out:
        out["turn"] = pd.to_numeric(out["turn"], errors="coerce").astype("float64")
    kind = out["error_kind"].astype(object)
    out["error_kind"] = kind.where(kind.notna() & (kind != ""), None)
    return out.sort_values("ts", kind="stable").reset_index(drop=True)


def _parquet_available() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def save_samples(df: pd.DataFrame, out_dir: Path, stem: str) -> Path:
    """Write the samples' SAMPLE_COLUMNS as ``<stem>.parquet`` (pyarrow present) or ``<stem>.csv.gz``, atomically."""
    df = df[SAMPLE_COLUMNS]
    path = out_dir / (f"{stem}.parquet" if _parquet_available() else f"{stem}.csv.gz")
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".parquet":
        df.to_parquet(tmp, index=False)
    else:
        df.to_csv(tmp, index=False, compression="gzip", date_format="%Y-%m-%dT%H:%M:%S.%fZ")
    tmp.replace(path)
    return path


def load_samples(path: str | Path) -> pd.DataFrame:
    """Read a samples file written by ``run_load`` (parquet or csv.gz) with its column types."""
    path = Path(path)
    if path.suffix == ".parquet":
        return _typed(pd.read_parquet(path)[SAMPLE_COLUMNS])
    df = pd.read_csv(path, compression="infer", keep_default_na=True)
    return _typed(df[SAMPLE_COLUMNS])


def remove_stale(out_dir: Path, stem: str) -> None:
    """Delete the files an earlier run of the same phase/step left, so a re-run replaces them."""
    for pattern in (f"{stem}.k6.*", f"{stem}.k6-summary.json", f"{stem}.samples.*", f"{stem}.warmup-samples.*",
                    f"{stem}.metrics.*"):
        for stale in out_dir.glob(pattern):
            stale.unlink(missing_ok=True)
