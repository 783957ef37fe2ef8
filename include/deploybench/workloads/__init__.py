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

import functools
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
        """What a run records of its workload: the name, the file's digest and the settings."""
        return {"name": self.name, "digest": self.digest, **self.spec.model_dump(mode="json",
                                                                                   exclude={"name", "description"})}

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
        asked to find a capacity."""
        s = self.spec
        where = f"workload {self.name!r} ({self.source})"
        if s.source.kind == "trace":
            rows = self.trace()
            for i, r in enumerate(rows):
                if r.input_tokens + r.output_tokens > max_model_len:
                    raise ConfigError(f"{where}: trace row {i + 1} asks for {r.input_tokens} + {r.output_tokens} "
                                      f"tokens, more than max_model_len={max_model_len}; raise max_model_len or "
                                      "remove such rows from the trace")
            if not s.source.follow_rate and phases and ("probe" in phases or "overload" in phases):
                raise ConfigError(f"{where}: a trace replayed on its own clock has one rate, so the probe and "
                                  "overload phases cannot vary it; set source.follow_rate = true (the trace's shape "
                                  "at each phase's rate) or run the sustained phase alone")
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


# -- plans ----------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """One k6 run's requests (a request: one conversation of one turn or more).

    ``arrivals_ms``: send times from the run's start, the first at 0, when the workload is timed (poisson, gamma,
    sessions, a trace); None for constant arrivals, which k6 spaces itself, taking request i mod len. Per request:
    ``own``/``output`` its first turn's own prompt tokens and answer tokens, ``group`` its shared prefix (-1: none),
    ``text`` its first turn's words from ``texts`` (a dataset's; -1: words made from the seed), ``system`` its
    system prompt in ``texts`` (-1: none), ``blocks`` its trace blocks (dense ids, ``block_tokens`` tokens each, the
    last one partial), ``more`` its later turns [own tokens, answer tokens, think ms, text] (sessions)."""

    workload: str
    seed: int
    prefixes: list[str]
    prefix_tokens: int
    own: list[int]
    output: list[int]
    group: list[int]
    arrivals_ms: list[float] | None = None
    texts: list[str] = field(default_factory=list)
    text_tokens: list[int] = field(default_factory=list)
    text: list[int] | None = None
    system: list[int] | None = None
    blocks: list[list[int]] | None = None
    block_tokens: int = 512
    more: list[list[list[float]]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # the words' salt: the run's own (runner.run_load), so that the words made from the seed differ between runs
    # while the lengths, groups and times stay the seed's (two runs of a workload offer the same shape)
    salt: int = 0

    def __len__(self) -> int:
        return len(self.own)

    def prompt_tokens(self, i: int) -> int:
        """The first turn's prompt tokens of request ``i``: its prefix, system prompt and own words."""
        sys_i = self.system[i] if self.system else -1
        return (self.own[i] + (self.prefix_tokens if self.group[i] >= 0 else 0)
                + (self.text_tokens[sys_i] if sys_i >= 0 else 0))

    def turns(self, i: int) -> int:
        return 1 + (len(self.more[i]) if self.more else 0)

    def requests(self) -> int:
        """Requests (turns) the plan sends in all."""
        return len(self) + (sum(len(m) for m in self.more) if self.more else 0)

    def write(self, path: Path) -> Path:
        """The plan as k6/run.js reads it: ``requests`` [[send ms or -1, own tokens, output tokens, group, text,
        system, blocks or 0, later turns or 0], ...] and the pools they point into."""
        n = len(self)
        at = self.arrivals_ms or [-1.0] * n
        text, system = self.text or [-1] * n, self.system or [-1] * n
        rows = [[round(at[i], 6), self.own[i], self.output[i], self.group[i], text[i], system[i],
                 self.blocks[i] if self.blocks else 0,
                 [[int(a), int(b), round(c, 1), int(d)] for a, b, c, d in self.more[i]] if self.more and self.more[i]
                 else 0] for i in range(n)]
        doc = {"workload": self.workload, "seed": self.seed, "salt": self.salt, "prefixes": self.prefixes,
               "prefix_tokens": self.prefix_tokens, "timed": self.arrivals_ms is not None, "texts": self.texts,
               "text_tokens": self.text_tokens, "block_tokens": self.block_tokens, "requests": rows}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        tmp.replace(path)
        return path

    def prompt(self, i: int, rng: Any) -> tuple[str, str, int, int]:
        """Request ``i``'s first turn (``i`` mod len) for a client that makes its own words: (system text or "",
        user text, prompt tokens, max_tokens); ``rng`` a random.Random for words made from nothing."""
        i %= len(self)
        sys_parts = [self.prefixes[self.group[i]]] if self.group[i] >= 0 else []
        if self.system and self.system[i] >= 0:
            sys_parts.append(self.texts[self.system[i]])
        if self.text and self.text[i] >= 0:
            user = self.texts[self.text[i]]
        elif self.blocks:
            user = block_text(self.blocks[i], self.own[i], self.block_tokens, self.salt)
        else:
            user = " ".join(WORDS[int(rng.random() * len(WORDS))] for _ in range(self.own[i]))
        return " ".join(sys_parts), user, self.prompt_tokens(i), self.output[i]

    def expected_prefix_hits(self, block_tokens: int = 16, cache_answers: bool = True) -> tuple[int, int]:
        """(hit tokens, queried tokens) an automatic prefix cache with room for everything (vLLM's, the simulated
        engine's) counts over this plan, with each shared prefix already cached: every turn's prompt is looked up
        as a chain of ``block_tokens``-token blocks, the longest cached run of whole blocks hits (at least one
        token is computed: a whole-cached prompt recomputes its last block), and its blocks are cached, with the
        answer's when ``cache_answers``. Tokens are told apart by where they come from (a prefix's, a text's, a
        trace block's, or a request's own), as the engine tells them apart by their words. For the tests and the
        benchmark: it walks every token."""
        seen: set[int] = set()
        for g in range(len(self.prefixes)):  # the workload's prefixes, cached before the run
            _insert(seen, [("p", g, j) for j in range(self.prefix_tokens)], block_tokens)
        hits = queries = 0
        for i in range(len(self)):
            keys: list[tuple] = ([("p", self.group[i], j) for j in range(self.prefix_tokens)]
                                 if self.group[i] >= 0 else [])
            if self.system and self.system[i] >= 0:
                keys += [("x", self.system[i], j) for j in range(self.text_tokens[self.system[i]])]
            turns = [(self.own[i], self.output[i], 0.0, self.text[i] if self.text else -1)] + list(
                self.more[i] if self.more else [])
            for k, (own, out, _think, txt) in enumerate(turns):
                own, out, txt = int(own), int(out), int(txt)
                if txt >= 0:
                    keys += [("x", txt, j) for j in range(own)]
                elif self.blocks:
                    keys += [("b", self.blocks[i][j // self.block_tokens], j % self.block_tokens)
                             for j in range(own)]
                else:
                    keys += [("r", i, k, j) for j in range(own)]
                hit = _lookup(seen, keys, block_tokens)
                hits += hit
                queries += len(keys)
                answer = [("a", i, k, j) for j in range(out)]
                _insert(seen, keys + answer if cache_answers else keys, block_tokens)
                keys = keys + answer
        return hits, queries


def _chain(keys: list, block_tokens: int) -> list[int]:
    out, h = [], 0
    for b in range(len(keys) // block_tokens):
        h = hash((h, tuple(keys[b * block_tokens:(b + 1) * block_tokens])))
        out.append(h)
    return out


def _insert(seen: set[int], keys: list, block_tokens: int) -> None:
    seen.update(_chain(keys, block_tokens))


def _lookup(seen: set[int], keys: list, block_tokens: int) -> int:
    n = 0
    for h in _chain(keys[: max(0, len(keys) - 1)], block_tokens):  # at least one token is computed
        if h not in seen:
            break
        n += block_tokens
    return n


def _mulberry32(seed: int) -> Any:
    """k6/lib/prompts.js's rng: the same seed gives the same numbers in both."""
    a = seed & 0xFFFFFFFF

    def nxt() -> float:
        nonlocal a
        a = (a + 0x6D2B79F5) & 0xFFFFFFFF
        t = a
        t = ((t ^ (t >> 15)) * (t | 1)) & 0xFFFFFFFF
        t ^= (t + (((t ^ (t >> 7)) * (t | 61)) & 0xFFFFFFFF)) & 0xFFFFFFFF
        return ((t ^ (t >> 14)) & 0xFFFFFFFF) / 4294967296

    return nxt


def block_text(blocks: list[int], tokens: int, block_tokens: int, salt: int = 0) -> str:
    """A trace request's prompt: block ``d`` is ``block_tokens`` words from a stream seeded by ``d`` and the run's
    ``salt`` (so one id is one text wherever it appears in a run); the last block is cut to make ``tokens`` in all.
    As k6/lib/prompts.js makes it."""
    words: list[str] = []
    for j, d in enumerate(blocks):
        n = min(block_tokens, tokens - j * block_tokens)
        nxt = _mulberry32(((d * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF) ^ (salt & 0xFFFFFFFF))
        words += [WORDS[int(nxt() * len(WORDS))] for _ in range(max(0, n))]
    return " ".join(words)


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


def _mean_of(d: Lengths) -> float:
    """The mean of a turn-count distribution, from a large draw (clips included)."""
    return float(_draw(_rng(1), d, 20_000, 1, 0.0, prompt=True).mean())


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


def _too_many(w: Workload, n: float) -> ConfigError:
    return ConfigError(f"workload {w.name!r}: a phase of about {n:.0f} requests is more than a plan holds "
                       f"({MAX_PLAN_REQUESTS}); shorten the phase or lower the rate")


def _arrivals(w: Workload, rng: Any, segs: list[tuple[float, float, float]], per_session: float) -> tuple[Any, float]:
    """(send times in s or None for k6's own spacing, expected count) of the sessions of a synthetic or dataset
    workload: the rate is in requests/s, so sessions of ``per_session`` turns arrive at rate / per_session."""
    import numpy as np

    s = w.spec
    segs = [(a / per_session, b / per_session, d) for a, b, d in segs]
    expected = sum((a + b) / 2 * d for a, b, d in segs)
    if expected > MAX_PLAN_REQUESTS:
        raise _too_many(w, expected)
    if s.arrival.process == "constant":
        if not w.timed:
            return None, expected
        ops = np.arange(0, math.ceil(expected), dtype=float)
    else:
        # exactly the expected number of requests (a phase offers its rate, not a random draw around it: a probe
        # step of 6 s at 13/s would otherwise offer 13 +- 11 % and be judged on what it did not offer), their gaps
        # the process's, scaled to fill the phase: for Poisson, the process given its count (uniform order
        # statistics); the first request at the start, as k6's executors have it
        n = max(1, round(expected))
        if s.arrival.process == "poisson":
            gaps = rng.exponential(1.0, n)
        else:
            cv = float(s.arrival.cv or 1.0)
            gaps = rng.gamma(1.0 / cv**2, cv**2, n)
        ops = np.concatenate([[0.0], np.cumsum(gaps[1:])]) * (expected / float(gaps.sum()))
    times = invert_rate(ops, segs)
    return times[~np.isnan(times)], expected


def make_plan(w: Workload, *, rate: float, duration_s: float, warmup_s: float, seed: int,
              stages: list[tuple[float, float]] | None = None, prompt_tokens: int = 200, output_tokens: int = 64,
              output_spread: float = 0.0, max_model_len: int = MAX_TOKENS) -> Plan:
    """The requests of one k6 run of ``w`` at ``rate`` requests/s (or along ``stages`` after the warm-up), drawn
    from ``seed``. A session's turns stop before the one whose conversation would no longer fit
    ``max_model_len``."""
    s = w.spec
    segs = rate_profile(rate, stages, warmup_s, duration_s)
    rng = _rng(seed)
    if s.source.kind == "trace":
        return _trace_plan(w, segs, warmup_s + duration_s, seed)
    convs = w.conversations() if s.source.kind == "dataset" else None
    if s.session is None:
        per_session = 1.0
    elif convs is not None:
        per_session = sum(len(c.turns) for c in convs) / len(convs)
    else:
        assert s.session.turns is not None
        per_session = _mean_of(s.session.turns)
    times, expected = _arrivals(w, rng, segs, per_session)
    n = max(1, len(times) if times is not None else math.ceil(expected) + 1)
    plan = Plan(w.name, seed, prefix_texts(w), s.prefix.tokens if s.prefix else 0, [], [], [],
                [float(t) * 1000.0 for t in times] if times is not None else None,
                meta={"expected_requests": expected * per_session, "process": s.arrival.process,
                      "turns_per_session": per_session})
    own = _draw(rng, s.input, n, prompt_tokens, output_spread, prompt=True)
    out = _draw(rng, s.output, n, output_tokens, output_spread, prompt=False)
    group = [-1] * n
    if s.prefix:
        shared = rng.random(n) < s.prefix.fraction
        picks = rng.integers(0, s.prefix.groups, n)
        group = [int(p) if sh else -1 for sh, p in zip(shared, picks)]
    plan.group = group
    if convs is not None:
        _dataset_rows(plan, w, convs, rng, n, out, max_model_len)
    else:
        plan.own, plan.output = own.tolist(), out.tolist()
        if s.session is not None:
            _synthetic_turns(plan, w, rng, prompt_tokens, output_tokens, output_spread, max_model_len)
    return plan


def _think_ms(w: Workload, rng: Any, n: int) -> list[float]:
    t = w.spec.session.think if w.spec.session else Think()
    if t.mean_s <= 0:
        return [0.0] * n
    draws = rng.exponential(t.mean_s, n) if t.dist == "exponential" else [t.mean_s] * n
    return [1000.0 * float(x) for x in draws]


def _synthetic_turns(plan: Plan, w: Workload, rng: Any, prompt_tokens: int, output_tokens: int, spread: float,
                     max_model_len: int) -> None:
    s = w.spec
    assert s.session is not None and s.session.turns is not None
    counts = _draw(rng, s.session.turns, len(plan), 1, 0.0, prompt=True)
    total = int(counts.sum()) - len(plan)
    own = _draw(rng, s.input, total, prompt_tokens, spread, prompt=True).tolist()
    out = _draw(rng, s.output, total, output_tokens, spread, prompt=False).tolist()
    think = _think_ms(w, rng, total)
    more: list[list[list[float]]] = []
    k = 0
    for i, c in enumerate(counts):
        used = plan.prompt_tokens(i) + plan.output[i]
        turns: list[list[float]] = []
        for _ in range(int(c) - 1):
            used += own[k] + out[k]
            if used <= max_model_len:
                turns.append([own[k], out[k], think[k], -1])
            k += 1
        more.append(turns)
    plan.more = more


def _dataset_rows(plan: Plan, w: Workload, convs: list[Any], rng: Any, n: int, fallback_out: Any,
                  max_model_len: int) -> None:
    """Requests from the sampled conversations: taken in a shuffled order (each once before any twice), with their
    own words; an answer's length is the dataset's where it has one, else the workload's [output]. A record whose
    first turn does not fit the context is left out (counted in ``meta``)."""
    from deploybench.workloads.sources import approx_tokens

    s = w.spec
    index: dict[str, int] = {}

    def pool(text: str) -> int:
        if text not in index:
            index[text] = len(plan.texts)
            plan.texts.append(text)
            plan.text_tokens.append(approx_tokens(text))
        return index[text]

    prefix = s.prefix.tokens if s.prefix else 0
    fits = [c for c in convs if prefix + approx_tokens(c.system) + approx_tokens(c.turns[0].user)
            + (c.turns[0].answer_tokens or int(fallback_out.max())) <= max_model_len]
    plan.meta.update(dataset_records=len(convs), dataset_records_too_long=len(convs) - len(fits))
    order: list[int] = []
    while len(order) < n:
        order += rng.permutation(len(fits)).tolist()
    plan.text, plan.system, plan.more = [], [], [] if s.session else None
    think = _think_ms(w, rng, sum(len(fits[j].turns) for j in order[:n]))
    k = 0
    for i, j in enumerate(order[:n]):
        c = fits[j]
        first = c.turns[0]
        plan.text.append(pool(first.user))
        plan.system.append(pool(c.system) if c.system else -1)
        plan.own.append(plan.text_tokens[plan.text[-1]])
        plan.output.append(int(first.answer_tokens or fallback_out[i]))
        if plan.more is not None:
            used = plan.prompt_tokens(i) + plan.output[-1]
            turns: list[list[float]] = []
            for t in c.turns[1:]:
                x = pool(t.user)
                a = int(t.answer_tokens or fallback_out[i])
                used += plan.text_tokens[x] + a
                if used > max_model_len:
                    break
                turns.append([plan.text_tokens[x], a, think[k], x])
                k += 1
            plan.more.append(turns)


def _trace_plan(w: Workload, segs: list[tuple[float, float, float]], window_s: float, seed: int) -> Plan:
    """A trace's rows in the phase's window: from ``start_s``, at ``speed`` (its own clock), or - ``follow_rate`` -
    its shape mapped onto the phase's rate profile (the trace's mean rate becomes the phase's). Hash ids become
    dense ids (the same id, the same words)."""
    import numpy as np

    src = w.spec.source
    rows = w.trace()
    at = np.array([r.at_ms for r in rows], dtype=float) / 1000.0 - src.start_s
    keep = at >= 0
    if src.follow_rate:
        span = max(1e-9, float(at[keep].max()) if keep.any() else 1e-9)
        mean_rate = max(1, int(keep.sum()) - 1) / span
        times = invert_rate(at[keep] * mean_rate, segs)
        idx = np.flatnonzero(keep)[~np.isnan(times)]
        sent = times[~np.isnan(times)]
    else:
        t = at / src.speed
        sel = keep & (t < window_s)
        idx, sent = np.flatnonzero(sel), t[sel]
    if len(idx) == 0:
        raise ConfigError(f"workload {w.name!r}: its trace has no request in the replayed window (from start_s = "
                          f"{src.start_s:g} s for {window_s:g} s at speed {src.speed:g}); lower start_s")
    if len(idx) > MAX_PLAN_REQUESTS:
        raise _too_many(w, len(idx))
    dense: dict[int, int] = {}
    blocks = [[dense.setdefault(h, len(dense)) for h in rows[i].hash_ids] for i in idx]
    own = [rows[i].input_tokens for i in idx]
    for i, b in zip(idx, blocks):
        if not b:  # a trace without shared blocks (Azure's): each request its own ids
            b.extend(dense.setdefault(-1 - int(i) * 4096 - j, len(dense))
                     for j in range(math.ceil(rows[i].input_tokens / src.block_tokens)))
    first = float(sent[0])
    return Plan(w.name, seed, [], 0, own, [rows[i].output_tokens for i in idx], [-1] * len(idx),
                [1000.0 * (float(x) - first) for x in sent], blocks=blocks, block_tokens=src.block_tokens,
                meta={"process": "trace", "trace_rows": len(rows), "first_row": int(idx[0]),
                      "offered_rps": len(idx) / window_s if not src.follow_rate else None})


def vu_scale(plan: Plan, w: Workload, p99_ms: float, duration_s: float) -> float:
    """How many more VUs than rate x P99 a timed plan needs: its busiest second against its mean (bursts), times
    (P99 + think time) / P99 for conversations (a VU holds a conversation through its pauses)."""
    import numpy as np

    scale = 1.0
    if plan.arrivals_ms:
        at = np.asarray(plan.arrivals_ms) / 1000.0
        span = max(1.0, float(at[-1]))
        per_s = np.bincount(at.astype(np.int64))
        scale = max(1.0, float(per_s.max()) / (len(at) / span))
    if w.spec.session is not None:
        scale *= 1.0 + 1000.0 * w.spec.session.think.mean_s / p99_ms
    return scale


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
