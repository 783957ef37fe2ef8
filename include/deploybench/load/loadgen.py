"""Several load generators, one phase: k6's execution segments split a phase across the inventory's load-generator
machines (``loadgens``), so that together they offer exactly its schedule and send no request twice.

With n generators, generator i runs ``k6 run --execution-segment i/n:(i+1)/n --execution-segment-sequence
0,1/n,...,1``: an arrival-rate executor then starts the iterations of its segment at the whole schedule's times, and
the timed plans' ``shared-iterations`` executor hands each its share of the plan's rows; k6's
``exec.scenario.iterationInTest`` is the index in the whole test (k6 1.1.0, checked by tests/integration/
test_loadgen.py: the generators' indexes are disjoint and cover 0..N-1), so row i of the plan is sent once, by one
generator.

For each phase (``run_split``):

1. each generator's clock is measured against the controller's (``clock_offset_ms``: ``date +%s%N`` over the
   transport, against the midpoint of the round trip, the best of a few) and the phase is refused above
   ``CLOCK_OFFSET_MAX_MS``, naming the generator and its offset, before anything starts;
2. ``k6/run.js``, its ``lib/`` and the phase's plan are copied into ``<run_dir>/load/<stem>`` on the generator
   (``transport.Cluster.run_dir``) through the run's transport (a tar on the command's input);
3. k6 starts detached there (``transport.spawn_script``: a pid file naming the command and the run), every
   generator with the same barrier ``DB_START_AT_MS`` (epoch ms): k6/run.js's setup() sleeps until then;
4. the controller polls each until all are done. A generator whose k6 exits with a code other than 0 or 99 (a
   threshold crossed: a verdict, not a failure), whose process is gone without an exit code, or whose session
   drops fails the phase, named; the others are stopped (their process groups, by pid file) first;
5. each one's JSON output, summary export and log come back to the controller's folder as
   ``<stem>.<generator>.k6.*`` (read in bounded base64 chunks: a node's output is hostile input).

The runner (``runner.run_load``) merges the samples into one phase with a ``generator`` column, sums the dropped
iterations and reports each generator's share (``GeneratorFigures``).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import re
import shlex
import tarfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploybench.errors import DeploybenchError
from deploybench.load.results import LoadError
from deploybench.paths import k6_dir
from deploybench.transport import alive_script, spawn_script, stop_script, warn_left_alone

if TYPE_CHECKING:
    from deploybench.transport import Cluster, Transport

LOG = logging.getLogger(__name__)

# A generator whose clock is further than this from the controller's is refused: its samples' times (request
# starts, the barrier) would shift its share of the schedule by as much, and the merged per-second figures with it.
CLOCK_OFFSET_MAX_MS = 50.0
CLOCK_TRIES = 3  # round trips per generator; the shortest one's midpoint is the estimate
# The barrier lies this far after the last start command, plus per endpoint the setup()'s readiness checks: every
# generator's k6 must have started, read its plan and checked the endpoints by then (run.js fails a generator that
# misses it by over a second).
BARRIER_LEAD_S = 3.0
BARRIER_PER_ENDPOINT_S = 0.2
POLL_S = 1.0  # each poll runs a few processes on the generator, inside its CPU (a quota, in a bench)
STATUS_TIMEOUT_S = 10.0  # one poll of one generator; past it its session counts as dropped
FETCH_CHUNK = 16 << 20  # raw bytes a fetch command sends (base64: 22 MB, under transport.MAX_OUTPUT)
MAX_FETCH = 4 << 30  # what one output file of a generator may hold
EXIT_OK, EXIT_THRESHOLDS = 0, 99


class GeneratorFailed(LoadError):
    """A load generator failed its share of a phase (k6's exit, a lost session, its clock): the phase fails."""


@dataclass(frozen=True)
class Generators:
    """The machines that split each phase, reached through ``cluster`` (the run's transports)."""

    cluster: Cluster
    names: list[str]
    clock_bound_ms: float = CLOCK_OFFSET_MAX_MS
    barrier_lead_s: float = BARRIER_LEAD_S  # more for generators slow to start k6 (a small CPU quota)

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names):
            raise LoadError(f"load generators {self.names} are named twice; each takes one execution segment")


@dataclass
class GeneratorOutput:
    """What one generator's k6 left, fetched to the controller."""

    name: str
    segment: str
    rc: int
    cpu_s: float | None
    offset_ms: float | None  # None: not measured (a k6-operator runner pod: the operator starts it)
    rtt_ms: float | None
    json_out: Path
    summary_out: Path
    log_out: Path


@dataclass
class _Remote:
    name: str
    segment: str
    folder: str
    argv: list[str]
    pid_path: str
    rc_path: str
    cpu_path: str
    json_out: str
    summary_out: str
    log_path: str
    offset_ms: float = 0.0
    rtt_ms: float = 0.0
    done: int | None = None
    stopped: bool = field(default=False)


# -- pure pieces --------------------------------------------------------------------------------------------------
def _frac(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def segments(n: int) -> tuple[list[str], str]:
    """(each generator's ``--execution-segment``, the ``--execution-segment-sequence`` all of them share): n equal
    parts of the test, ``["0:1/3", "1/3:2/3", "2/3:1"]`` and ``"0,1/3,2/3,1"`` for three."""
    if n < 1:
        raise LoadError(f"{n} load generators: a phase needs at least one")
    cuts = [Fraction(i, n) for i in range(n + 1)]
    return [f"{_frac(a)}:{_frac(b)}" for a, b in zip(cuts, cuts[1:], strict=False)], ",".join(_frac(c) for c in cuts)


def parse_clock(text: str, sent_ns: int, got_ns: int) -> tuple[float, float]:
    """(offset ms of the remote clock to ours, round trip ms) from a remote ``date +%s%N`` read between ``sent_ns``
    and ``got_ns`` (our epoch ns): the remote time against the midpoint. Anything but digits is refused."""
    out = text.strip()
    if not re.fullmatch(r"[0-9]{10,20}", out):
        raise ValueError(f"`date +%s%N` printed {out[:60]!r}, not epoch nanoseconds (a date without %N support?)")
    return (2 * int(out) - sent_ns - got_ns) / 2e6, (got_ns - sent_ns) / 1e6  # in integers first: ns since 1970


def parse_status(text: str) -> tuple[str, int | None]:
    """The poll's answer: ("running", None), ("gone", None) or ("done", exit code); ("bad", None) for anything else
    (a node's output is not trusted to be what the script prints)."""
    line = text.strip()
    if line in ("running", "gone"):
        return line, None
    m = re.fullmatch(r"rc ([0-9]{1,3})", line)
    return ("done", int(m.group(1))) if m else ("bad", None)


def parse_cpu(text: str) -> float | None:
    """CPU seconds of k6 from the shell's ``times`` (second line: children's user and system time, ``0m1.23s``)."""
    lines = text.strip().splitlines()
    if len(lines) < 2:
        return None
    num = r"([0-9]{1,6})m([0-9]{1,6}(?:\.[0-9]{1,9})?)s"
    got = re.fullmatch(rf"\s*{num}\s+{num}\s*", lines[1])
    if not got:
        return None
    a, b, c, d = got.groups()
    return round(60 * int(a) + float(b) + 60 * int(c) + float(d), 3)


WRAPPER = 'rc=$1; cpu=$2; shift 2; "$@"; s=$?; times > "$cpu"; echo $s > "$rc.tmp"; mv "$rc.tmp" "$rc"'


def k6_argv(k6: str, folder: str, segment: str, sequence: str) -> list[str]:
    """The command a generator runs: k6 inside a small shell that writes its exit code (and CPU time) to files the
    controller polls (``WRAPPER``)."""
    return ["sh", "-c", WRAPPER, "deploybench-k6", f"{folder}/k6.rc", f"{folder}/k6.cpu",
            k6, "run", "--quiet", "--no-color", "--address", "", "--out", f"json={folder}/k6.json.gz",
            "--summary-export", f"{folder}/k6-summary.json", "--execution-segment", segment,
            "--execution-segment-sequence", sequence, f"{folder}/run.js"]


def status_script(r: _Remote) -> str:
    rc = shlex.quote(r.rc_path)
    done = f'printf "rc %s\\n" "$(head -c 8 {rc})"'
    return (f"if [ -f {rc} ]; then {done}; elif ( {alive_script(r.pid_path, r.argv)} ); then echo running; "
            f"elif [ -f {rc} ]; then {done}; else echo gone; fi")


def bundle(plan: Path) -> bytes:
    """A tar of what k6 needs on a generator: run.js, lib/*.js and the phase's plan (as plan.json)."""
    buf = io.BytesIO()
    root = k6_dir()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(root / "run.js", arcname="run.js")
        for js in sorted((root / "lib").glob("*.js")):
            tar.add(js, arcname=f"lib/{js.name}")
        tar.add(plan, arcname="plan.json")
    return buf.getvalue()


# -- against the generators ---------------------------------------------------------------------------------------
def clock_offset_ms(t: Transport, tries: int = CLOCK_TRIES) -> tuple[float, float]:
    """(offset ms, round trip ms) of the machine behind ``t`` to this one: of ``tries`` reads, the one with the
    shortest round trip (the first one may open the connection)."""
    best = (0.0, float("inf"))
    for _ in range(max(1, tries)):
        sent = time.time_ns()
        res = t.run(["date", "+%s%N"], timeout=10)
        got = time.time_ns()
        if res.rc != 0:
            raise GeneratorFailed(f"load generator {t.node.name}: `date +%s%N` exited {res.rc}: {res.stderr[-200:]}")
        try:
            off = parse_clock(res.stdout, sent, got)
        except ValueError as exc:
            raise GeneratorFailed(f"load generator {t.node.name}: {exc}") from exc
        if off[1] < best[1]:
            best = off
    return best


def check_clocks(gens: Generators) -> dict[str, tuple[float, float]]:
    """Every generator's (clock offset, round trip) in ms; GeneratorFailed naming the first beyond the bound."""
    got = dict(zip(gens.names, _parallel(lambda n: clock_offset_ms(gens.cluster[n]), gens.names), strict=True))
    for name, (off, rtt) in got.items():
        if abs(off) > gens.clock_bound_ms:
            raise GeneratorFailed(
                f"load generator {name}: its clock is {off:+.1f} ms off the controller's (round trip {rtt:.1f} ms), "
                f"beyond the bound of {gens.clock_bound_ms:g} ms (loadgen.CLOCK_OFFSET_MAX_MS): its share of the "
                "schedule would start that much early or late; synchronise its clock (chrony or systemd-timesyncd "
                "against the controller's time source) or take it out of the inventory's loadgens")
    return got


def _parallel(fn: Any, items: list[str]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(items)))) as pool:
        return list(pool.map(fn, items))


def _fetch(t: Transport, remote: str, local: Path, required: bool = True) -> bool:
    """Copy ``remote`` to ``local`` in base64 chunks of FETCH_CHUNK; its size is read first and bounded."""
    res = t.run(["stat", "-c", "%s", remote], timeout=30)
    size_text = res.stdout.strip()
    if res.rc != 0 or not re.fullmatch(r"[0-9]{1,15}", size_text):
        if not required:
            return False
        raise GeneratorFailed(f"load generator {t.node.name}: {remote} is missing ({(res.stderr or size_text)[-200:]})")
    size = int(size_text)
    if size > MAX_FETCH:
        raise GeneratorFailed(f"load generator {t.node.name}: {remote} holds {size} bytes, more than the "
                              f"{MAX_FETCH >> 20} MiB deploybench fetches of one output")
    tmp = local.with_name(local.name + ".part")
    with open(tmp, "wb") as out:
        for k in range(0, max(1, -(-size // FETCH_CHUNK))):
            # iflag=fullblock: one read() of a big block may return less (seen: 442,368 of 447,945 bytes)
            chunk = t.run(f"dd if={shlex.quote(remote)} bs={FETCH_CHUNK} skip={k} count=1 iflag=fullblock status=none "
                          "| base64 -w0",
                          timeout=120).check()
            try:
                out.write(base64.b64decode(chunk.stdout.strip(), validate=True))
            except ValueError as exc:
                raise GeneratorFailed(f"load generator {t.node.name}: {remote}: chunk {k} is not base64") from exc
    if tmp.stat().st_size != size:
        raise GeneratorFailed(f"load generator {t.node.name}: {remote}: fetched {tmp.stat().st_size} of {size} bytes")
    tmp.replace(local)
    return True


def _stop(gens: Generators, remotes: list[_Remote], why: str) -> None:
    """Stop every generator's k6 that has not ended (its process group, by pid file); a machine that cannot be
    reached is logged, not raised: the phase already fails for ``why``."""
    def one(r: _Remote) -> None:
        if r.stopped or r.done is not None:
            return
        try:
            warn_left_alone(gens.cluster[r.name].run(stop_script(r.pid_path, grace_s=2.0, argv=r.argv), timeout=20))
            r.stopped = True
        except Exception as exc:  # noqa: BLE001 - a machine out of reach: logged, the phase already fails for why
            LOG.error("load generator %s: could not stop its k6 (%s) after %s", r.name, exc, why)

    _parallel(lambda name: one(next(r for r in remotes if r.name == name)), [r.name for r in remotes])


def run_split(gens: Generators, env: Mapping[str, str], *, stem: str, out_dir: Path, plan: Path, timeout_s: float,
              n_endpoints: int = 1) -> list[GeneratorOutput]:
    """Run one phase split across ``gens``: k6 with ``env`` (the DB_* variables; DB_PLAN is rewritten to each
    generator's copy) on each, from one barrier; their outputs fetched to ``out_dir`` as ``<stem>.<name>.k6.*``.
    GeneratorFailed names the generator that failed; nothing of the phase is left running on any of them."""
    segs, sequence = segments(len(gens.names))
    clocks = check_clocks(gens)
    data = bundle(plan)
    remotes: list[_Remote] = []
    for name, seg in zip(gens.names, segs, strict=True):
        folder = f"{gens.cluster.run_dir(name)}/load/{stem}"
        k6 = gens.cluster.inventory.machine(name)
        k6_cmd = getattr(k6, "k6", "k6")
        remotes.append(_Remote(
            name=name, segment=seg, folder=folder, argv=k6_argv(k6_cmd, folder, seg, sequence),
            pid_path=f"{folder}/k6.pid", rc_path=f"{folder}/k6.rc", cpu_path=f"{folder}/k6.cpu",
            json_out=f"{folder}/k6.json.gz", summary_out=f"{folder}/k6-summary.json", log_path=f"{folder}/k6.log",
            offset_ms=clocks[name][0], rtt_ms=clocks[name][1]))

    def stage(r: _Remote) -> None:
        q = shlex.quote(r.folder)
        gens.cluster[r.name].run(f"rm -rf {q} && mkdir -p {q} && tar -x -C {q}", stdin=data, timeout=60).check()

    try:
        _parallel(lambda name: stage(next(r for r in remotes if r.name == name)), gens.names)
    except DeploybenchError as exc:
        raise GeneratorFailed(f"copying the k6 script and plan to the load generators failed: {exc}") from exc
    lead_s = gens.barrier_lead_s + BARRIER_PER_ENDPOINT_S * n_endpoints
    start_at_ms = int((time.time() + lead_s) * 1000)
    run_key = gens.cluster.run_key
    lock = threading.Lock()
    started: list[str] = []

    def start(r: _Remote) -> None:
        renv = {**env, "DB_PLAN": f"{r.folder}/plan.json", "DB_START_AT_MS": str(start_at_ms),
                "DB_GENERATORS": str(len(remotes)), "K6_NO_USAGE_REPORT": "true"}
        gens.cluster[r.name].run(spawn_script(r.argv, r.log_path, r.pid_path, env=renv, run_key=run_key),
                                 timeout=30).check()
        with lock:
            started.append(r.name)

    LOG.info("load %s: split across %d generators (%s), clocks %s, barrier at %d", stem, len(remotes),
             ", ".join(f"{r.name} {r.segment}" for r in remotes),
             ", ".join(f"{n} {o:+.2f} ms" for n, (o, _) in clocks.items()), start_at_ms)
    finished = False
    try:
        try:
            _parallel(lambda name: start(next(r for r in remotes if r.name == name)), gens.names)
        except DeploybenchError as exc:
            raise GeneratorFailed(f"starting k6 on the load generators failed ({', '.join(started) or 'none'} "
                                  f"started): {exc}") from exc
        _watch(gens, remotes, time.monotonic() + timeout_s + lead_s)
        finished = True
    finally:
        if not finished:
            _stop(gens, remotes, "the phase failed")
    return _collect(gens, remotes, out_dir, stem)


def _watch(gens: Generators, remotes: list[_Remote], deadline: float) -> None:
    """Poll every generator until each k6 has exited; the first failure stops the others and raises."""
    while True:
        for r in remotes:
            if r.done is not None:
                continue
            try:
                res = gens.cluster[r.name].run(status_script(r), timeout=STATUS_TIMEOUT_S)
            except Exception as exc:  # a transport error, or paramiko's own (a channel that cannot open)
                # a status check that timed out on a busy machine leaves its k6 running: _stop tries it too (the
                # transport reconnects), and logs it when the machine is really gone
                raise GeneratorFailed(f"load generator {r.name} ({r.segment} of the phase): its session dropped "
                                      f"mid-phase ({type(exc).__name__}: {exc}); every generator's k6 was stopped "
                                      "(or, where the machine could not be reached, logged)") from exc
            if res.rc < 0:  # no exit status: the session ended under the check (its machine died, or sshd did)
                raise GeneratorFailed(f"load generator {r.name} ({r.segment} of the phase): its session dropped "
                                      "mid-phase (its status check ended without an exit status); every generator's "
                                      "k6 was stopped (or, where the machine could not be reached, logged)")
            state, rc = parse_status(res.stdout)
            if state == "done" and rc is not None:
                r.done = rc
                if rc not in (EXIT_OK, EXIT_THRESHOLDS):
                    tail = _remote_tail(gens, r)
                    raise GeneratorFailed(f"load generator {r.name} ({r.segment} of the phase): k6 exited with code "
                                          f"{rc}; the other generators were stopped; last lines of its log "
                                          f"{r.log_path}:\n{tail}")
            elif state == "gone":
                raise GeneratorFailed(f"load generator {r.name} ({r.segment} of the phase): its k6 is gone without "
                                      "an exit code (killed, or the machine restarted); the other generators were "
                                      "stopped")
            elif state == "bad":
                raise GeneratorFailed(f"load generator {r.name}: its status check answered {res.stdout[:120]!r} "
                                      f"(exit {res.rc}); the other generators were stopped")
        if all(r.done is not None for r in remotes):
            return
        if time.monotonic() > deadline:
            late = [r.name for r in remotes if r.done is None]
            raise GeneratorFailed(f"load generators {', '.join(late)} did not finish their share of the phase in time; "
                                  "they were stopped")
        time.sleep(POLL_S)


def _remote_tail(gens: Generators, r: _Remote, lines: int = 15) -> str:
    try:
        res = gens.cluster[r.name].run(["tail", "-n", str(lines), r.log_path], timeout=10)
        return res.stdout[-4000:] or "(empty)"
    except DeploybenchError as exc:
        return f"(cannot read it: {exc})"


def _collect(gens: Generators, remotes: list[_Remote], out_dir: Path, stem: str) -> list[GeneratorOutput]:
    def one(r: _Remote) -> GeneratorOutput:
        t = gens.cluster[r.name]
        base = out_dir / f"{stem}.{r.name}"
        json_out, summary_out, log_out = (Path(f"{base}.k6.json.gz"), Path(f"{base}.k6-summary.json"),
                                          Path(f"{base}.k6.log"))
        _fetch(t, r.json_out, json_out)
        _fetch(t, r.summary_out, summary_out)
        _fetch(t, r.log_path, log_out, required=False)
        cpu = t.run(["head", "-c", "200", r.cpu_path], timeout=10)
        return GeneratorOutput(name=r.name, segment=r.segment, rc=r.done if r.done is not None else -1,
                               cpu_s=parse_cpu(cpu.stdout) if cpu.ok else None, offset_ms=round(r.offset_ms, 3),
                               rtt_ms=round(r.rtt_ms, 3), json_out=json_out, summary_out=summary_out, log_out=log_out)

    try:
        return _parallel(lambda name: one(next(r for r in remotes if r.name == name)), [r.name for r in remotes])
    except DeploybenchError as exc:
        raise GeneratorFailed(f"fetching the load generators' k6 output failed: {exc}") from exc


def merge_summaries(summaries: Mapping[str, dict]) -> dict:
    """One summary for the phase from each generator's ``--summary-export``: every metric's ``count`` summed and
    its thresholds crossed if crossed on any generator (the parts the runner reads); each generator's under
    ``generators``."""
    metrics: dict[str, dict] = {}
    for summary in summaries.values():
        for name, body in (summary.get("metrics") or {}).items():
            if not isinstance(body, dict):
                continue
            into = metrics.setdefault(name, {})
            c = body.get("count")  # a generator's file: only a finite, non-negative count is a count
            if isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c) and 0 <= c <= 1e15:
                into["count"] = into.get("count", 0) + c
            for expr, failed in (body.get("thresholds") or {}).items():
                into.setdefault("thresholds", {})[expr] = bool(into.get("thresholds", {}).get(expr)) or bool(failed)
    return {"metrics": metrics, "generators": dict(summaries)}


def read_summary(path: Path) -> dict:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoadError(f"{path}: cannot read k6's summary export ({exc!r})") from exc
    if not isinstance(got, dict):
        raise LoadError(f"{path}: k6's summary export is not a JSON object")
    return got
