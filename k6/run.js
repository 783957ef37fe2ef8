// deploybench load entry script: one open-model phase (or one step of the capacity search).
//
// Everything comes from the environment (see lib/config.js); deploybench.load sets it. The phase runs
// for DB_WARMUP_S + DB_DURATION_S at DB_RATE requests/s (constant-arrival-rate), or, when DB_STAGES
// is set, DB_WARMUP_S at DB_RATE then ramps through the stages (ramping-arrival-rate, the overload
// phase). With a timed plan (DB_PLAN_TIMED: the workload's poisson or gamma arrivals, conversations, a trace)
// each request is sent at its own time from the plan instead, a conversation's later turns after the answers and
// think times before them. All are open models: a slow server cannot slow the client down. The requests' lengths,
// words and shared prefixes come from the plan (DB_PLAN, deploybench.workloads). Requests started in the
// first DB_WARMUP_S seconds are tagged window=warmup and left out of the thresholds and of the figures
// deploybench reports. Every sample is tagged with phase, step, node and the run tags (DB_TAGS).
import http from 'k6/http';
import exec from 'k6/execution';
import { sleep } from 'k6';
import { SharedArray } from 'k6/data';

import { loadConfig, ms, scenario, scheduledMs } from './lib/config.js';
import { makePrompts, planConversation, turnPrompt } from './lib/prompts.js';
import { buildRequest, errorKind, readinessPaths, readResponse } from './lib/requests.js';
import { recordDropped, recordSample } from './lib/metrics.js';

const cfg = loadConfig(__ENV);
// The workload's plan (DB_PLAN, written by deploybench.workloads) or, run by hand, lib/prompts.js's prompt set.
// SharedArray parses its file once and hands each VU the items it reads.
const planned = cfg.plan ? new SharedArray('plan', () => JSON.parse(open(cfg.plan)).requests) : null;
const planHead = cfg.plan ? new SharedArray('planHead', () => {
  const doc = JSON.parse(open(cfg.plan));
  return [{ seed: doc.seed, salt: doc.salt || 0, prefixes: doc.prefixes, prefixTokens: doc.prefix_tokens,
    texts: doc.texts || [], textTokens: doc.text_tokens || [], blockTokens: doc.block_tokens || 512 }];
})[0] : null;
const prompts = cfg.plan ? null : new SharedArray('prompts', () =>
  makePrompts(cfg.prompts, cfg.promptTokens, cfg.seed, cfg.outputTokens, cfg.outputSpread));
const shape = scenario(cfg);
// several generators start together: setup() waits for the barrier, so setup must be given the time until it
const barrierS = cfg.startAtMs ? Math.max(0, (cfg.startAtMs - Date.now()) / 1000) : 0;
// a generator whose setup ends this long after the barrier would send its share late: it fails instead
const BARRIER_MISSED_MS = 1000;

export const options = {
  scenarios: {
    load: {
      ...shape,
      ...(cfg.timed ? {} : { preAllocatedVUs: cfg.preVUs, maxVUs: cfg.maxVUs }),
      // let requests in flight at the end finish (they belong to the measured window)
      gracefulStop: ms(cfg.timeoutS + 1),
      tags: { phase: cfg.phase, step: cfg.step },
    },
  },
  tags: cfg.tags, // run tags (run_key, config cell...) on every sample
  // SLO thresholds on the measured window only: P99 of successful requests and the error rate.
  thresholds: {
    'db_request{window:measure,ok:true}': [`p(99)<${cfg.p99Ms}`],
    'db_request_failed{window:measure}': [`rate<=${cfg.maxErrorRate}`],
    // no threshold: named only so that the summary export counts each source of token counts
    'db_tokens_from{tokens_from:usage}': [],
    'db_tokens_from{tokens_from:stream}': [],
    'db_tokens_from{tokens_from:text}': [],
  },
  summaryTrendStats: ['avg', 'min', 'med', 'p(90)', 'p(99)', 'p(99.9)', 'max', 'count'],
  setupTimeout: ms(30 + 10 * cfg.endpoints.length + barrierS),
  teardownTimeout: '10s',
};

// Fail fast: every endpoint must answer its readiness path before any load is offered.
export function setup() {
  const paths = readinessPaths(cfg.api);
  for (const ep of cfg.endpoints) {
    const seen = [];
    let ready = false;
    for (const path of paths) {
      const res = http.get(`${ep.url}${path}`, { timeout: '5s', tags: { name: 'readiness', node: ep.node } });
      seen.push(`${path} -> ${res.status || res.error || 'no answer'}`);
      if (res.status === 200) {
        ready = true;
        break;
      }
    }
    if (!ready) {
      exec.test.abort(`endpoint not ready: node ${ep.node} at ${ep.url} (${seen.join('; ')})`);
    }
  }
  if (cfg.startAtMs) {
    const wait = cfg.startAtMs - Date.now();
    if (wait > 0) sleep(wait / 1000);
    else if (-wait > BARRIER_MISSED_MS) {
      exec.test.abort(`barrier missed: setup ended ${-wait} ms after the start time ${cfg.startAtMs} (DB_START_AT_MS)`);
    }
  }
}

// The targets as they are now: DB_ENDPOINTS, or (DB_TARGETS_URL) the list the page gives, re-read at most every
// DB_TARGETS_EVERY_MS by each VU until the page says it is final (every added engine in, or failed). k6 cannot
// re-read a file after its init stage, hence a page (on loopback, HTTP/1.1 keep-alive). A page that does not answer
// or answers nonsense leaves the list as it was. Its requests are tagged name=targets and never recorded as samples
// (those are db_request points, recordSample).
let targets = cfg.endpoints;
let targetsReadAt = -Infinity;
let targetsFinal = false;
function currentTargets() {
  if (!cfg.targetsUrl || targetsFinal || Date.now() - targetsReadAt < cfg.targetsEveryMs) return targets;
  targetsReadAt = Date.now();
  const res = http.get(cfg.targetsUrl, { timeout: '2s', tags: { name: 'targets' } });
  if (res.status !== 200) return targets;
  try {
    const got = JSON.parse(res.body);
    const list = got && got.targets;
    if (Array.isArray(list) && list.length > 0 && list.every((e) => e && e.node && e.url && e.model)) {
      targets = list;
      targetsFinal = got.final === true;
    }
  } catch (e) { /* keep the list as it was */ }
  return targets;
}

export default function () {
  const i = exec.scenario.iterationInTest;
  const now = currentTargets();
  const n = now.length;
  const endpoint = now[i % n]; // a conversation stays on one endpoint (and its prefix cache)
  let dueMs;
  if (cfg.timed) {
    if (i >= planned.length) return;
    dueMs = planned[i][0];
    const wait = dueMs - (Date.now() - exec.scenario.startTime);
    if (wait > 0) sleep(wait / 1000);
  } else {
    dueMs = scheduledMs(cfg, i);
  }
  if (!planned) {
    send(endpoint, prompts[Math.floor(i / n) % prompts.length], dueMs, false, {});
    return;
  }
  const k = cfg.timed ? i : i % planned.length;
  const conv = planConversation(planned[k], planHead, k);
  const history = [];
  let historyTokens = 0;
  for (let t = 0; t < conv.turns.length; t++) {
    const turn = conv.turns[t];
    if (t > 0) {
      if (turn.thinkMs > 0) sleep(turn.thinkMs / 1000);
      dueMs = Date.now() - exec.scenario.startTime; // a later turn is due when its think time is over
    }
    const read = send(endpoint, turnPrompt(conv, turn, history, historyTokens), dueMs, cfg.timed && t === 0,
      { conv: k, turn: t });
    if (!read || !read.ok) break; // a conversation whose turn failed has no answer to go on from
    history.push({ role: 'user', content: turn.user }, { role: 'assistant', content: read.text });
    historyTokens += turn.tokens + read.outputTokens;
  }
}

// One request: sent, read and recorded; returns what readResponse read (null when dropped).
function send(endpoint, prompt, dueMs, droppable, where) {
  const req = buildRequest(cfg, endpoint, prompt);
  const t0 = Date.now();
  const lagMs = t0 - exec.scenario.startTime - dueMs;
  const window = t0 - exec.scenario.startTime < cfg.warmupS * 1000 ? 'warmup' : 'measure';
  if (droppable && lagMs > cfg.dropLagMs) {
    recordDropped(window); // no VU was free when it was due: dropped, as an arrival-rate executor drops
    return null;
  }
  const res = http.post(req.url, req.body, {
    headers: req.headers,
    timeout: ms(cfg.timeoutS),
    tags: { node: endpoint.node, window, name: req.url.replace(/^https?:\/\/[^/]+/, '') },
    responseType: 'text',
  });

  let read = { ok: false, errorKind: errorKind(res), promptTokens: prompt.tokens, outputTokens: 0, text: '' };
  if (res.status >= 200 && res.status < 300) read = readResponse(cfg, res, prompt);

  recordSample({
    node: endpoint.node,
    window,
    t0,
    lagMs,
    // a request that got no answer has no timings; its latency is the time until k6 gave up
    latencyMs: res.status > 0 ? res.timings.duration : Date.now() - t0,
    ok: read.ok,
    status: res.status,
    errorKind: read.errorKind,
    promptTokens: read.promptTokens,
    outputTokens: read.outputTokens,
    tokensFrom: read.tokensFrom,
    ...where,
  });
  return read;
}
