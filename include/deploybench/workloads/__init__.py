"""Workloads: what traffic a load phase offers, as data picked by name.

A workload file (``<name>.toml``: the shipped ones beside this module, the operator's own in the folders named by
``$DEPLOYBENCH_WORKLOADS``, the way engine profiles work) says

* ``[arrival]`` how requests arrive: ``constant`` (evenly spaced: k6's constant-arrival-rate, today's shape),
  ``poisson`` (exponential gaps) or ``gamma`` (gamma gaps with coefficient of variation ``cv``: above 1 bursty,
  below 1 more even than Poisson; vLLM's ``bench serve --burstiness`` is 1/cv^2);
* ``[input]`` and ``[output]`` the length of each request's own prompt and of its answer, in tokens, drawn from a
  distribution: ``form`` (the run's prompt/output tokens, spread as the form says: the prompt uniform over
  0.5-1.5 x, the output over 1 +- output_spread), ``fixed``, ``uniform`` (min..max), ``normal`` (mean, sigma in
  tokens), ``lognormal`` (mean in tokens, sigma of the log) or ``empirical`` (``bins`` of [low, high, weight]);
  normal and lognormal draws are clipped to [min, max];
* ``[prefix]`` shared prefixes: ``groups`` system prompts of ``tokens`` tokens each; a ``fraction`` of the requests
  starts with one of them (picked uniformly), the shape of inference-perf's shared-prefix data. The prefixes are the
  workload's own (from its seed), the same in every phase and run, as an application's system prompts are;
* ``seed`` and ``seed_per_phase``: everything else is drawn from a seed that differs per phase and per probe step
  (unless ``seed_per_phase = false``: then the phase's own seed, probe step n's being n and the others' 0, as
  before workloads existed), so a later phase does not resend an earlier one's prompts for a prefix cache to reward.

A run compiles its workload into a *plan* per k6 run (``make_plan``): each request's own length, its answer's length,
its prefix group and, for poisson and gamma, its send time. k6 (``k6/run.js``) reads the plan and makes the words;
the TTFT sampler takes its requests from the same plan (``Plan.prompt``). Everything here is pure and deterministic.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deploybench.errors import ConfigError

WORKLOAD_DIR = Path(__file__).resolve().parent
WORKLOAD_ENV = "DEPLOYBENCH_WORKLOADS"
DEFAULT_WORKLOAD = "synthetic"
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
MAX_FILE_BYTES = 1 << 20  # a workload file is a page of settings, never a dataset
MAX_TOKENS = 1_048_576
MAX_PLAN_REQUESTS = 5_000_000  # 2,000 req/s for 40 minutes: past it a phase is split, not planned whole

# the words prompts are made of, as k6/lib/prompts.js has them: short common English words, one token each for
# most tokenizers (with the leading space), so a prompt of N words is about N tokens (exactly N for the sim)
WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part"
).split()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


class Lengths(_Strict):
    """A length distribution in tokens (see the module doc)."""

    dist: Literal["form", "fixed", "uniform", "normal", "lognormal", "empirical"]
    value: Tokens | None = None  # fixed
    mean: float | None = Field(None, ge=1, le=MAX_TOKENS)  # normal, lognormal
    sigma: float | None = Field(None, gt=0, le=MAX_TOKENS)  # normal: tokens; lognormal: of the log (at most 4)
    min: Tokens | None = None  # uniform, and the clip of normal/lognormal
    max: Tokens | None = None
    bins: list[tuple[Tokens, Tokens, Annotated[float, Field(ge=0)]]] | None = Field(None, min_length=1,
                                                                                      max_length=1000)

    @model_validator(mode="after")
    def _coherent(self) -> Lengths:
        need = {"form": set(), "fixed": {"value"}, "uniform": {"min", "max"}, "normal": {"mean", "sigma"},
                "lognormal": {"mean", "sigma"}, "empirical": {"bins"}}[self.dist]
        allowed = need | ({"min", "max"} if self.dist in ("normal", "lognormal") else set())
        given = {k for k in ("value", "mean", "sigma", "min", "max", "bins") if getattr(self, k) is not None}
        if missing := sorted(need - given):
            raise ValueError(f"dist = {self.dist!r} needs {', '.join(missing)}")
        if extra := sorted(given - allowed):
            raise ValueError(f"dist = {self.dist!r} takes {', '.join(sorted(allowed)) or 'nothing else'}, "
                             f"not {', '.join(extra)}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min = {self.min} is above max = {self.max}")
        if self.dist == "lognormal" and self.sigma is not None and self.sigma > 4:
            raise ValueError(f"sigma = {self.sigma} is the log's standard deviation: at most 4")
        if self.bins is not None:
            if any(lo > hi for lo, hi, _ in self.bins):
                raise ValueError("each bin is [low, high, weight] with low <= high")
            if not sum(w for _, _, w in self.bins) > 0:
                raise ValueError("the bins' weights sum to 0")
        return self

    def upper(self, form_tokens: int, spread: float) -> int:
        """The longest length this distribution can draw."""
        if self.dist == "form":
            return math.ceil(form_tokens * (1.5 if spread < 0 else 1 + spread))
        if self.dist == "fixed":
            return int(self.value or 1)
        if self.dist == "empirical":
            return max(hi for _, hi, _ in self.bins or [])
        if self.max is not None:
            return self.max
        return MAX_TOKENS


class Arrival(_Strict):
    process: Literal["constant", "poisson", "gamma"] = "constant"
    cv: float | None = Field(None, gt=0, le=10)  # gamma: coefficient of variation of the gaps

    @model_validator(mode="after")
    def _coherent(self) -> Arrival:
        if (self.process == "gamma") != (self.cv is not None):
            raise ValueError("cv (the gaps' coefficient of variation) is set for process = 'gamma' and only then")
        return self


class Prefix(_Strict):
    groups: int = Field(ge=1, le=10_000)
    tokens: Tokens
    fraction: float = Field(1.0, gt=0, le=1)


class WorkloadFile(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field("", max_length=2000)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    seed_per_phase: bool = True
    arrival: Arrival = Field(default_factory=Arrival)
    input: Lengths = Field(default_factory=lambda: Lengths(dist="form"))
    output: Lengths = Field(default_factory=lambda: Lengths(dist="form"))
    prefix: Prefix | None = None


@dataclass(frozen=True)
class Workload:
    """A validated workload file and where it came from (``source``: the file; ``digest``: its sha256)."""

    spec: WorkloadFile
    source: str
    digest: str

    @property
    def name(self) -> str:
        return self.spec.name

    def seed_for(self, phase: str, step: int, fallback: int) -> int:
        """The seed of one k6 run: derived from the workload's seed, the phase and the step (``seed_per_phase``),
        else ``fallback`` (the phase's own: probe step n's n, the others' 0)."""
        if not self.spec.seed_per_phase:
            return fallback
        h = hashlib.blake2b(f"{self.spec.seed}:{phase}:{step}".encode(), digest_size=4).digest()
        return int.from_bytes(h, "little") & 0x7FFFFFFF

    def summary(self) -> dict[str, Any]:
        """What a run records of its workload: the name, the file's digest and the settings."""
        return {"name": self.name, "digest": self.digest, **self.spec.model_dump(mode="json",
                                                                                   exclude={"name", "description"})}

    def check_fits(self, prompt_tokens: int, output_tokens: int, output_spread: float, max_model_len: int) -> None:
        """Refuse a workload whose longest request cannot fit the engine's context (before any node is touched)."""
        s = self.spec
        longest = (s.prefix.tokens if s.prefix else 0) + s.input.upper(prompt_tokens, -1) + s.output.upper(
            output_tokens, output_spread)
        if longest > max_model_len:
            raise ConfigError(
                f"workload {self.name!r}: its longest request ({longest} tokens: prefix + input max + output max) "
                f"does not fit max_model_len={max_model_len}; raise max_model_len, or bound the workload's lengths "
                f"(max = ...) in {self.source}")


# -- finding workloads ----------------------------------------------------------------------------------------------
def workload_dirs() -> list[Path]:
    """The shipped workloads, then the folders of $DEPLOYBENCH_WORKLOADS (os.pathsep-separated)."""
    extra = [Path(p) for p in os.environ.get(WORKLOAD_ENV, "").split(os.pathsep) if p.strip()]
    return [WORKLOAD_DIR, *extra]


def load_file(path: str | Path) -> Workload:
    """One workload file, validated; ConfigError names the file, the key and what is allowed."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"workload {path}: cannot read it: {exc.strerror or exc}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"workload {path}: over {MAX_FILE_BYTES} bytes; a workload file holds settings, a dataset "
                          "belongs in a file of its own")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"workload {path}: cannot read it as TOML: {exc}") from exc
    try:
        spec = WorkloadFile.model_validate(data)
    except ValidationError as exc:
        msgs = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e["loc"]) or "file"
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] == "extra_forbidden":
                msg = "unknown key (a typo?)"
            msgs.append(f"{where}: {msg}")
        raise ConfigError(f"workload {path}: " + "; ".join(msgs)) from None
    if spec.name != path.stem:
        raise ConfigError(f"workload {path}: name = {spec.name!r} must be the file's name ({path.stem!r})")
    return Workload(spec, str(path), hashlib.sha256(raw).hexdigest())


def workloads() -> dict[str, Workload]:
    """Every workload by name, read now. Two files of one name are refused."""
    out: dict[str, Workload] = {}
    for folder in workload_dirs():
        if not folder.is_dir():
            raise ConfigError(f"${WORKLOAD_ENV} names {str(folder)!r}, which is not a folder; fix or unset it")
        for f in sorted(folder.glob("*.toml")):
            w = load_file(f)
            if w.name in out:
                raise ConfigError(f"workload {w.name!r} is defined twice: {out[w.name].source} and {f}; rename one")
            out[w.name] = w
    return out


def workload(name: str) -> Workload:
    """The workload of that name; ConfigError lists the known ones."""
    known = workloads()
    try:
        return known[name]
    except KeyError:
        raise ConfigError(f"unknown workload {name!r}; choose one of: {', '.join(sorted(known))} (or add {name}.toml "
                          f"to a folder named by ${WORKLOAD_ENV})") from None


# -- plans ----------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """One k6 run's requests. ``arrivals_ms`` (poisson, gamma; None for constant: k6 spaces them) are send times
    from the run's start, the first at 0; ``own``/``output``/``group`` each request's own prompt tokens, answer
    tokens and prefix group (-1: none). With constant arrivals k6 takes request i mod len."""

    workload: str
    seed: int
    prefixes: list[str]
    prefix_tokens: int
    own: list[int]
    output: list[int]
    group: list[int]
    arrivals_ms: list[float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.own)

    def prompt_tokens(self, i: int) -> int:
        return self.own[i] + (self.prefix_tokens if self.group[i] >= 0 else 0)

    def write(self, path: Path) -> Path:
        """The plan as k6/run.js reads it: ``requests`` [[send ms or -1, own tokens, output tokens, group], ...]."""
        at = self.arrivals_ms or [-1.0] * len(self)
        doc = {"workload": self.workload, "seed": self.seed, "prefixes": self.prefixes,
               "prefix_tokens": self.prefix_tokens, "timed": self.arrivals_ms is not None,
               "requests": [[round(a, 3), o, n, g] for a, o, n, g in zip(at, self.own, self.output, self.group)]}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        tmp.replace(path)
        return path

    def prompt(self, i: int, rng: Any) -> tuple[str, str, int, int]:
        """Request ``i`` (mod len) for a client that makes its own words: (prefix text or "", own text, prompt
        tokens, max_tokens); ``rng`` a random.Random for the words."""
        i %= len(self)
        own = " ".join(WORDS[int(rng.random() * len(WORDS))] for _ in range(self.own[i]))
        pre = self.prefixes[self.group[i]] if self.group[i] >= 0 else ""
        return pre, own, self.prompt_tokens(i), self.output[i]

    def expected_prefix_hits(self, block_tokens: int = 16) -> tuple[int, int]:
        """(hit tokens, queried tokens) an automatic prefix cache with room for everything would count over this
        plan, given each group's prefix already cached: a prefixed request hits its prefix's whole blocks
        (``block_tokens``; a block holding the prefix's end and the request's own words never matches), the rest
        of its prompt is computed. Requests without a prefix hit nothing."""
        per = (self.prefix_tokens // block_tokens) * block_tokens
        hits = sum(per for g in self.group if g >= 0)
        return hits, sum(self.prompt_tokens(i) for i in range(len(self)))


def _rng(seed: int) -> Any:
    import numpy as np

    return np.random.Generator(np.random.PCG64(seed))


def _draw(rng: Any, d: Lengths, n: int, form_tokens: int, spread: float, *, prompt: bool) -> Any:
    import numpy as np

    if d.dist == "form":
        if prompt:  # today's prompts: uniform over [0.5, 1.5] x the mean
            x = np.maximum(1, np.rint(form_tokens * (0.5 + rng.random(n))))
        else:
            x = np.maximum(1, np.rint(form_tokens * (1 - spread + 2 * spread * rng.random(n))))
    elif d.dist == "fixed":
        x = np.full(n, d.value)
    elif d.dist == "uniform":
        x = rng.integers(d.min, d.max, n, endpoint=True)
    elif d.dist == "normal":
        x = np.rint(rng.normal(d.mean, d.sigma, n))
    elif d.dist == "lognormal":
        assert d.mean is not None and d.sigma is not None
        mu = math.log(d.mean) - d.sigma**2 / 2  # so that the mean is ``mean`` before the clip
        x = np.rint(rng.lognormal(mu, d.sigma, n))
    else:
        bins = np.array([[lo, hi, w] for lo, hi, w in d.bins or []], dtype=float)
        pick = rng.choice(len(bins), n, p=bins[:, 2] / bins[:, 2].sum())
        x = np.floor(bins[pick, 0] + rng.random(n) * (bins[pick, 1] - bins[pick, 0] + 1))
    lo, hi = (d.min or 1), (d.max or MAX_TOKENS)
    return np.clip(x, max(1, lo), hi).astype(np.int64)


def rate_profile(rate: float, stages: list[tuple[float, float]] | None, warmup_s: float,
                 duration_s: float) -> list[tuple[float, float, float]]:
    """The offered rate as linear segments (rate at start, rate at end, seconds): the warm-up at ``rate``, then the
    stages ramping from it (k6's ramping-arrival-rate), else ``rate`` for ``duration_s``."""
    segs = [(rate, rate, warmup_s)] if warmup_s > 0 else []
    if stages:
        frm = rate
        for target, secs in stages:
            segs.append((frm, target, secs))
            frm = target
    else:
        segs.append((rate, rate, duration_s))
    return segs


def invert_rate(counts: Any, segs: list[tuple[float, float, float]]) -> Any:
    """The times (s) at which the integral of the rate reaches each of ``counts`` (sorted; operational time);
    past the last segment: NaN."""
    import numpy as np

    counts = np.asarray(counts, dtype=float)
    out = np.full(len(counts), np.nan)
    t0, c0 = 0.0, 0.0
    for a, b, d in segs:
        n = (a + b) / 2 * d
        sel = (counts >= c0) & (counts < c0 + n) & np.isnan(out)
        left = counts[sel] - c0
        k = (b - a) / d
        if abs(k) < 1e-12:
            out[sel] = t0 + (left / a if a > 0 else 0.0)
        else:
            out[sel] = t0 + (-a + np.sqrt(np.maximum(0.0, a * a + 2 * k * left))) / k
        t0, c0 = t0 + d, c0 + n
    return out


def make_plan(w: Workload, *, rate: float, duration_s: float, warmup_s: float, seed: int,
              stages: list[tuple[float, float]] | None = None, prompt_tokens: int = 200, output_tokens: int = 64,
              output_spread: float = 0.0) -> Plan:
    """The requests of one k6 run of ``w`` at ``rate`` (or along ``stages`` after the warm-up), from ``seed``."""
    import numpy as np

    s = w.spec
    segs = rate_profile(rate, stages, warmup_s, duration_s)
    expected = sum((a + b) / 2 * d for a, b, d in segs)
    rng = _rng(seed)
    arrivals = None
    if s.arrival.process == "constant":
        n = math.ceil(expected) + 1
    else:
        # unit-rate gaps in operational time, then mapped through the inverse of the rate's integral
        budget = int(expected + 10 * math.sqrt(expected + 1) * max(1.0, s.arrival.cv or 1.0) + 16)
        if budget > MAX_PLAN_REQUESTS:
            raise ConfigError(f"workload {w.name!r}: a phase of about {expected:.0f} requests is more than a plan "
                              f"holds ({MAX_PLAN_REQUESTS}); shorten the phase or lower the rate")
        if s.arrival.process == "poisson":
            gaps = rng.exponential(1.0, budget)
        else:
            cv = float(s.arrival.cv or 1.0)
            gaps = rng.gamma(1.0 / cv**2, cv**2, budget)
        ops = np.cumsum(gaps) - gaps[0]  # the first request at the start, as k6's executors have it
        times = invert_rate(ops[ops < expected], segs)
        arrivals = [float(t) * 1000.0 for t in times if not math.isnan(t)]
        n = len(arrivals)
    if n > MAX_PLAN_REQUESTS:
        raise ConfigError(f"workload {w.name!r}: a phase of about {n} requests is more than a plan holds "
                          f"({MAX_PLAN_REQUESTS}); shorten the phase or lower the rate")
    n = max(n, 1)
    own = _draw(rng, s.input, n, prompt_tokens, output_spread, prompt=True)
    out = _draw(rng, s.output, n, output_tokens, output_spread, prompt=False)
    group = np.full(n, -1, dtype=np.int64)
    prefixes: list[str] = []
    if s.prefix:
        shared = rng.random(n) < s.prefix.fraction
        group[shared] = rng.integers(0, s.prefix.groups, int(shared.sum()))
        prefixes = prefix_texts(w)
    if arrivals is not None:
        arrivals = arrivals[:n]
    return Plan(w.name, seed, prefixes, s.prefix.tokens if s.prefix else 0, own.tolist(), out.tolist(),
                group.tolist(), arrivals, {"expected_requests": expected, "process": s.arrival.process})


def prefix_texts(w: Workload) -> list[str]:
    """The workload's shared prefixes: from its own seed only, the same in every phase and run. Each starts with
    its group's number so that two groups differ from their first block on."""
    s = w.spec
    if not s.prefix:
        return []
    rng = _rng(s.seed ^ 0x5EED)
    out = []
    for g in range(s.prefix.groups):
        idx = rng.integers(0, len(WORDS), s.prefix.tokens - 1)
        out.append(" ".join([f"g{g}", *(WORDS[i] for i in idx)]))
    return out
