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
* ``[source]`` where the words come from: made from the seed (``synthetic``), a ``dataset`` (JSONL prompts or chat
  messages, ShareGPT conversations; sampled, read as hostile input: ``sources``) or a timed ``trace`` (Mooncake's
  JSONL with the hash ids of shared blocks, Azure's CSV), replayed from ``start_s`` at ``speed`` on its own clock,
  or with ``follow_rate`` its shape at each phase's rate;
* ``[session]`` conversations: turns per session (synthetic; a dataset's conversations bring theirs) and the think
  time between a turn's answer and the next turn, each turn sent with the whole conversation so far;
* ``seed`` and ``seed_per_phase``: everything is drawn from a seed that differs per phase and per probe step
  (unless ``seed_per_phase = false``: then the phase's own seed, probe step n's being n and the others' 0, as
  before workloads existed), so a later phase does not resend an earlier one's prompts for a prefix cache to reward;
  the words made from it also differ per run (``Plan.salt``), the shape (lengths, groups, times) does not.

A run compiles its workload into a *plan* per k6 run (``make_plan``): per request its lengths, prefix group, the
source of its words, its later turns and, when timed (poisson, gamma, sessions, traces), its send time. k6
(``k6/run.js``) reads the plan and makes the words; the TTFT sampler takes its requests from the same plan
(``Plan.prompt``). ``Plan.expected_prefix_hits`` is what an automatic prefix cache must count over it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import tomllib
from dataclasses import dataclass
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


DATASET_FORMATS = ("jsonl", "sharegpt")
TRACE_FORMATS = ("mooncake", "azure")


class Source(_Strict):
    """Where each request's words (and, for a trace, its time) come from."""

    kind: Literal["synthetic", "dataset", "trace"] = "synthetic"
    path: str | None = Field(None, max_length=1024)  # relative to the workload file's folder, inside it
    format: Literal["jsonl", "sharegpt", "mooncake", "azure"] | None = None
    max_bytes: int = Field(1 << 30, ge=1, le=1 << 36)  # the file is refused past this size
    sample: int = Field(2000, ge=1, le=100_000)  # dataset: records a run samples (reservoir sampling)
    block_tokens: int = Field(512, ge=16, le=65_536)  # trace: tokens per hash id (Mooncake's: 512)
    speed: float = Field(1.0, gt=0, le=1000)  # trace: replay this many times faster than recorded
    start_s: float = Field(0.0, ge=0, le=10_000_000)  # trace: where the replay starts
    follow_rate: bool = False  # trace: its shape at each phase's rate (probe, overload) instead of its own clock

    @model_validator(mode="after")
    def _coherent(self) -> Source:
        if self.kind == "synthetic":
            if self.path is not None or self.format is not None:
                raise ValueError("kind = 'synthetic' makes its own words: no path or format")
            return self
        formats = DATASET_FORMATS if self.kind == "dataset" else TRACE_FORMATS
        if self.path is None or self.format not in formats:
            raise ValueError(f"kind = {self.kind!r} needs a path and a format, one of {', '.join(formats)}")
        parts = Path(self.path).parts
        if Path(self.path).is_absolute() or ".." in parts or not parts:
            raise ValueError(f"path = {self.path!r} must be relative to the workload file's folder and stay in it "
                             "(no leading /, no ..)")
        return self


class Think(_Strict):
    """The pause between a turn's answer and the next turn, in seconds."""

    dist: Literal["fixed", "exponential"] = "exponential"
    mean_s: float = Field(0.0, ge=0, le=3600)


class Session(_Strict):
    """Multi-turn conversations: each turn is sent with the whole conversation so far (the answers included)."""

    turns: Lengths | None = None  # synthetic: turns per session; a dataset's conversations bring their own
    think: Think = Field(default_factory=Think)
    # what a run's rates mean (load_rate, probe_start_rps, probe_max_rps, slo_min_rps): conversations started per
    # second (the user's unit: the report gives requests/s beside it), or requests (turns) per second
    rate: Literal["sessions", "requests"] = "sessions"

    @model_validator(mode="after")
    def _coherent(self) -> Session:
        if self.turns is not None and self.turns.dist == "form":
            raise ValueError("turns: dist = 'form' is for lengths; give fixed, uniform, normal, lognormal or empirical")
        return self


class WorkloadFile(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field("", max_length=2000)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    seed_per_phase: bool = True
    source: Source = Field(default_factory=Source)
    arrival: Arrival = Field(default_factory=Arrival)
    input: Lengths = Field(default_factory=lambda: Lengths(dist="form"))
    output: Lengths = Field(default_factory=lambda: Lengths(dist="form"))
    prefix: Prefix | None = None
    session: Session | None = None

    @model_validator(mode="after")
    def _coherent(self) -> WorkloadFile:
        kind = self.source.kind
        if kind == "trace" and (self.session or self.prefix or self.arrival.process != "constant"):
            raise ValueError("a trace brings its own times, lengths and shared blocks: no [session], [prefix] or "
                             "[arrival] with kind = 'trace'")
        if self.session is not None:
            if kind == "synthetic" and self.session.turns is None:
                raise ValueError("session.turns is needed with synthetic words (a dataset's conversations bring "
                                 "their own turns)")
            if kind == "dataset" and self.session.turns is not None:
                raise ValueError("session.turns: a dataset's conversations bring their own turns; leave it out")
        return self


@dataclass(frozen=True)
class Workload:
    """A validated workload file and where it came from (``source``: the file; ``digest``: its sha256)."""

    spec: WorkloadFile
    source: str
    digest: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def timed(self) -> bool:
        """Its requests carry their own send times (k6 sends each at its time) rather than k6's even spacing."""
        s = self.spec
        return s.arrival.process != "constant" or s.session is not None or s.source.kind == "trace"

    def seed_for(self, phase: str, step: int, fallback: int) -> int:
        """The seed of one k6 run: derived from the workload's seed, the phase and the step (``seed_per_phase``),
        else ``fallback`` (the phase's own: probe step n's n, the others' 0)."""
        if not self.spec.seed_per_phase:
            return fallback
        h = hashlib.blake2b(f"{self.spec.seed}:{phase}:{step}".encode(), digest_size=4).digest()
        return int.from_bytes(h, "little") & 0x7FFFFFFF

    def summary(self) -> dict[str, Any]:
        """What a run records of its workload (and its series' identity holds): the name, the file's sha256, its
        dataset's or trace's sha256, and the settings."""
        out = {"name": self.name, "digest": self.digest,
               **self.spec.model_dump(mode="json", exclude={"name", "description"})}
        if self.spec.source.kind != "synthetic":
            out["data_sha256"] = _sha256_of(self.data_path(), self.spec.source.max_bytes)
        return out

    def turns_per_session(self) -> float:
        """The mean turns of one of its conversations (1.0 without sessions): a dataset's sampled conversations, or
        the mean of the turns' distribution."""
        s = self.spec
        if s.session is None:
            return 1.0
        if s.source.kind == "dataset":
            convs = self.conversations()
            return sum(len(c.turns) for c in convs) / len(convs)
        from deploybench.workloads.plan import _mean_of

        assert s.session.turns is not None
        return _mean_of(s.session.turns)

    def rate_scale(self) -> float:
        """Requests/s per unit of the run's rates: the mean turns of a conversation when the file counts its rate in
        sessions, else 1."""
        sess = self.spec.session
        return self.turns_per_session() if sess is not None and sess.rate == "sessions" else 1.0

    def data_path(self) -> Path:
        """The dataset's or trace's file: relative to the workload file's folder and inside it (a symbolic link
        out of the folder is refused as ``..`` is)."""
        folder = Path(self.source).resolve().parent
        path = (folder / (self.spec.source.path or "")).resolve()
        if not path.is_relative_to(folder):
            raise ConfigError(f"workload {self.source}: source.path = {self.spec.source.path!r} leads out of its "
                              f"folder ({path}); keep the data beside the workload file")
        return path

    def conversations(self) -> list[Any]:
        """The dataset's sampled conversations (deploybench.workloads.sources), read once per process."""
        src, path = self.spec.source, self.data_path()
        return _read_dataset(str(path), _stamp(path), src.format or "", src.sample, self.spec.seed, src.max_bytes)

    def trace(self) -> list[Any]:
        """The trace's rows (deploybench.workloads.sources.TraceRow), read once per process."""
        src, path = self.spec.source, self.data_path()
        return _read_trace(str(path), _stamp(path), src.format or "", src.max_bytes, src.block_tokens)

    def check_fits(self, prompt_tokens: int, output_tokens: int, output_spread: float, max_model_len: int,
                   phases: list[str] | None = None) -> None:
        """Refuse, before any node is touched, a workload a run cannot offer: a dataset or trace that does not read
        (hostile input is refused here), a request longer than the engine's context, a trace at its own clock
        asked to find a capacity, to spike or to overload (its own clock sends neither)."""
        s = self.spec
        where = f"workload {self.name!r} ({self.source})"
        if s.source.kind == "trace":
            rows = self.trace()
            for i, r in enumerate(rows):
                if r.input_tokens + r.output_tokens > max_model_len:
                    raise ConfigError(f"{where}: trace row {i + 1} asks for {r.input_tokens} + {r.output_tokens} "
                                      f"tokens, more than max_model_len={max_model_len}; raise max_model_len or "
                                      "remove such rows from the trace")
            varying = [p for p in ("probe", "spike", "overload") if p in (phases or [])]
            if not s.source.follow_rate and varying:
                raise ConfigError(f"{where}: a trace replayed on its own clock has one rate, so the probe, spike "
                                  f"and overload phases cannot vary it (load_phases has {', '.join(varying)}); set "
                                  "source.follow_rate = true (the trace's shape at each phase's rate) or run the "
                                  "sustained phase alone")
            return
        if s.source.kind == "dataset":
            convs = self.conversations()
            fits = [c for c in convs if _first_tokens(c) + (c.turns[0].answer_tokens or s.output.upper(
                output_tokens, output_spread)) + (s.prefix.tokens if s.prefix else 0) <= max_model_len]
            if not fits:
                raise ConfigError(f"{where}: none of the {len(convs)} sampled records fits max_model_len="
                                  f"{max_model_len} (prompt + answer); raise max_model_len or use shorter records")
            return
        longest = (s.prefix.tokens if s.prefix else 0) + s.input.upper(prompt_tokens, -1) + s.output.upper(
            output_tokens, output_spread)
        if longest > max_model_len:
            raise ConfigError(
                f"{where}: its longest request ({longest} tokens: prefix + input max + output max) does not fit "
                f"max_model_len={max_model_len}; raise max_model_len, or bound the workload's lengths (max = ...)")


def _sha256_of(path: Path, limit: int) -> str:
    """The sha256 of a data file, read in chunks (refused past ``limit`` bytes, as the readers refuse it)."""
    h, seen = hashlib.sha256(), 0
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                seen += len(chunk)
                if seen > limit:
                    raise ConfigError(f"{path}: more than the workload's limit of {limit} bytes (max_bytes)")
                h.update(chunk)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    return h.hexdigest()


def _stamp(path: Path) -> tuple[int, int]:
    """(size, mtime) of the data file: a file changed since it was read is read again."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _read_dataset(path: str, stamp: tuple[int, int], fmt: str, sample: int, seed: int, max_bytes: int) -> list[Any]:
    from deploybench.workloads import sources

    return sources.read_dataset(path, fmt, sample=sample, seed=seed, max_bytes=max_bytes)[0]  # type: ignore[arg-type]


@functools.lru_cache(maxsize=8)
def _read_trace(path: str, stamp: tuple[int, int], fmt: str, max_bytes: int, block_tokens: int) -> list[Any]:
    from deploybench.workloads import sources

    return sources.read_trace(path, fmt, max_bytes=max_bytes, block_tokens=block_tokens)  # type: ignore[arg-type]


def _first_tokens(conv: Any) -> int:
    from deploybench.workloads import sources

    return sources.approx_tokens(conv.system) + sources.approx_tokens(conv.turns[0].user)


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


# the plans (deploybench.workloads.plan), by their names here: what the load stage and the tests use
from deploybench.workloads.plan import (  # noqa: E402 - it builds on the classes above
    Plan,
    block_text,
    invert_rate,
    make_plan,
    prefix_texts,
    rate_profile,
    vu_scale,
)

__all__ = ["DEFAULT_WORKLOAD", "MAX_TOKENS", "WORDS", "WORKLOAD_ENV", "Lengths", "Plan", "Workload", "WorkloadFile",
           "block_text", "invert_rate", "load_file", "make_plan", "prefix_texts", "rate_profile", "vu_scale",
           "workload", "workload_dirs", "workloads"]
