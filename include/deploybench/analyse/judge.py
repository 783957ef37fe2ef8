"""What the newest run of a series says: the verdict a scheduled regression benchmark acts on.

``history.analyse_series`` describes a series' *state* (its change points; "regression" for every
run after a confirmed slowdown). A scheduled benchmark needs the *news*: did something change with
this run? One run is judged against the runs before it (ordered by logical date), replaying the
series from its start so that a run's verdict depends on the runs up to it only:

- **regression / improvement**: the run is outside the current level by more than the run-to-run
  noise allows (a one-sided prediction test, ``t = (x - level) / (noise x level x sqrt(1 + 1/n))``
  against Student's t with the pooled degrees of freedom, ``p < alpha``) and by at least
  ``min_change``; or a change point that the runs before it did not show is confirmed with this
  run (``history.change_points``: PELT + Welch t-test), i.e. earlier ``suspect`` runs confirmed.
- **suspect**: the run is outside the noise band (``|t| >= band``, and ``min_change``) but neither
  test confirms it yet: one odd run, or the first run of a change too small to be sure of.
- **no change**: otherwise, or too few runs to know the noise (``min_baseline``).

The *level* is the mean of the runs since the last change (a flagged run or a confirmed change
point starts a new level, so the runs after a reported regression are judged against the new
level and are not reported again); the *noise* is the relative standard deviation within levels,
pooled over the whole series and floored at ``noise_floor``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from deploybench.analyse.figures import HIGHER_IS_BETTER
from deploybench.analyse.history import Params as ChangeParams
from deploybench.analyse.history import change_points

log = logging.getLogger(__name__)

METHOD = "deploybench-judge"
VERDICTS = ("regression", "improvement", "suspect", "no change")


@dataclass(frozen=True)
class JudgeParams:
    alpha: float = 0.01  # one-sided p of the single-run prediction test
    band: float = 3.0  # the noise band, in standard deviations of one run around the level
    min_change: float = 0.03  # relative: smaller differences are never news
    min_baseline: int = 3  # runs before the judged one needed to know the noise
    noise_floor: float = 0.005  # relative
    window: int = 100  # newest runs replayed (older ones are history's business)
    change: ChangeParams = field(default_factory=ChangeParams)


@dataclass
class Judgement:
    """The verdict on one run for one metric, and what it was judged against."""

    metric: str
    verdict: str  # VERDICTS
    direction: str | None  # worse | better (None: no change)
    value: float | None
    level: float | None  # the mean it was compared with
    magnitude: float  # relative difference from the level (signed)
    p_value: float | None
    noise: float | None  # relative run-to-run standard deviation used
    against: list[int]  # indices of the runs it was judged against
    change_at: int | None = None  # index of the first run of the change (a confirmed change point may be earlier)
    how: str = ""  # single-run test | change point confirmed | too few runs | ...

    @property
    def fails(self) -> bool:
        return self.verdict == "regression"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _worse(metric: str, delta: float) -> bool:
    return delta < 0 if metric in HIGHER_IS_BETTER else delta > 0


def pooled_noise(x: np.ndarray, cuts: Sequence[int], floor: float) -> tuple[float, int]:
    """Relative standard deviation within the levels that ``cuts`` (start indices) separate, and its
    degrees of freedom (runs minus levels with at least one run)."""
    edges = sorted({c for c in cuts if 0 <= c < len(x)} | {0}) + [len(x)]
    ss, df = 0.0, 0
    for a, b in zip(edges, edges[1:]):
        seg = x[a:b]
        if len(seg) >= 2 and seg.mean():
            ss += float((((seg - seg.mean()) / seg.mean()) ** 2).sum())
            df += len(seg) - 1
    sd = math.sqrt(ss / df) if df else 0.0
    return max(sd, floor), df


def judge_values(metric: str, values: Sequence[float], params: JudgeParams | None = None) -> list[Judgement]:
    """The verdict on every run of one metric's series (oldest first), each from the runs up to it."""
    from scipy import stats

    p = params or JudgeParams()
    x = np.asarray(values, dtype=float)
    cuts: list[int] = [0]  # where each level starts
    reported: list[int] = []  # change starts already reported (flagged runs, confirmed change points)
    out: list[Judgement] = []
    for i in range(len(x)):
        start = max(c for c in cuts if c < i) if i else 0
        base = x[start:i]
        noise, df = pooled_noise(x[:i], cuts, p.noise_floor)
        if len(base) == 0 or i < p.min_baseline or df < 2 or not np.isfinite(x[:i + 1]).all():
            out.append(Judgement(metric, "no change", None, float(x[i]), None, 0.0, None, None, list(range(start, i)),
                                 how=f"too few runs to know the noise ({i} before it, {p.min_baseline} needed)"))
            continue
        level = float(base.mean())
        mag = (x[i] - level) / level if level else 0.0
        t = (x[i] - level) / (noise * abs(level) * math.sqrt(1 + 1 / len(base))) if level else 0.0
        pv = float(stats.t.sf(abs(t), df))
        direction = "worse" if _worse(metric, mag) else "better"
        against = list(range(start, i))
        if pv < p.alpha and abs(mag) >= p.min_change:
            cuts.append(i)
            reported.append(i)
            out.append(Judgement(metric, "regression" if direction == "worse" else "improvement", direction,
                                 float(x[i]), level, float(mag), pv, noise, against, i, "single-run test"))
            continue
        confirmed = _newly_confirmed(x[:i + 1], reported, p)
        if confirmed is not None:
            b, m0, m1, pc = confirmed
            cuts.append(b)
            cuts.sort()
            reported.append(b)
            cmag = (m1 - m0) / m0 if m0 else 0.0
            cdir = "worse" if _worse(metric, cmag) else "better"
            out.append(Judgement(metric, "regression" if cdir == "worse" else "improvement", cdir, float(x[i]),
                                 m0, float(cmag), pc, noise, list(range(max(c for c in cuts if c < b) if b else 0, b)),
                                 b, "change point confirmed"))
            continue
        if abs(t) >= p.band and abs(mag) >= p.min_change:
            out.append(Judgement(metric, "suspect", direction, float(x[i]), level, float(mag), pv, noise, against, i,
                                 "outside the noise band, not confirmed"))
        else:
            out.append(Judgement(metric, "no change", None, float(x[i]), level, float(mag), pv, noise, against,
                                 how="within the noise band" if abs(t) < p.band else "smaller than min_change"))
    return out


def _newly_confirmed(x: np.ndarray, reported: list[int], p: JudgeParams) -> tuple[int, float, float, float] | None:
    """The newest confirmed change point of ``x`` that is not (within min_size of) one already reported."""
    near = max(1, p.change.min_size)
    fresh = [c for c in change_points(x, p.change) if all(abs(c[0] - r) >= near for r in reported)
             and abs(c[1] - c[2]) / abs(c[1] or 1.0) >= p.min_change]
    return fresh[-1] if fresh else None


def judge_newest(metric: str, values: Sequence[float], params: JudgeParams | None = None) -> Judgement:
    """The verdict on the last run of ``values`` (the window's newest runs replayed)."""
    p = params or JudgeParams()
    vals = list(values)[-p.window:]
    offset = len(values) - len(vals)
    j = judge_values(metric, vals, p)[-1]
    j.against = [a + offset for a in j.against]
    j.change_at = None if j.change_at is None else j.change_at + offset
    return j
