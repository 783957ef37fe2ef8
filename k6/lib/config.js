// Run configuration, read once from the environment (__ENV).
//
// The Python runner (deploybench.load) sets every DB_* variable; defaults exist only so a person can
// run the script by hand. A missing or malformed value throws in the init context, which k6 reports
// as a script error (exit code 107) before any request is sent.

function num(env, name, fallback) {
  const raw = env[name];
  if (raw === undefined || raw === '') {
    if (fallback === undefined) throw new Error(`${name} is required (a number)`);
    return fallback;
  }
  const v = Number(raw);
  if (!Number.isFinite(v)) throw new Error(`${name}=${JSON.stringify(raw)} is not a number`);
  return v;
}

function str(env, name, fallback) {
  const raw = env[name];
  if (raw === undefined || raw === '') {
    if (fallback === undefined) throw new Error(`${name} is required`);
    return fallback;
  }
  return raw;
}

function bool(env, name, fallback) {
  const raw = env[name];
  if (raw === undefined || raw === '') return fallback;
  return ['1', 'true', 'yes', 'on'].includes(String(raw).toLowerCase());
}

function json(env, name, fallback) {
  const raw = env[name];
  if (raw === undefined || raw === '') {
    if (fallback === undefined) throw new Error(`${name} is required (JSON)`);
    return fallback;
  }
  try {
    return JSON.parse(raw);
  } catch (e) {
    throw new Error(`${name} is not valid JSON: ${e}`);
  }
}

export const APIS = ['completions', 'chat', 'triton'];

export function loadConfig(env) {
  const endpoints = json(env, 'DB_ENDPOINTS');
  if (!Array.isArray(endpoints) || endpoints.length === 0) {
    throw new Error('DB_ENDPOINTS must be a non-empty JSON list of {"node","url","model"}');
  }
  for (const ep of endpoints) {
    if (!ep || !ep.node || !ep.url || !ep.model) {
      throw new Error(`DB_ENDPOINTS entry ${JSON.stringify(ep)} needs node, url and model`);
    }
    ep.url = String(ep.url).replace(/\/+$/, '');
  }
  const api = str(env, 'DB_API', 'completions');
  if (!APIS.includes(api)) throw new Error(`DB_API=${api} is not one of ${APIS.join(', ')}`);
  const cfg = {
    endpoints,
    api,
    rate: num(env, 'DB_RATE'),
    durationS: num(env, 'DB_DURATION_S'),
    warmupS: num(env, 'DB_WARMUP_S', 0),
    preVUs: num(env, 'DB_PRE_VUS', 0),
    maxVUs: num(env, 'DB_MAX_VUS', 0),
    phase: str(env, 'DB_PHASE', 'sustained'),
    step: str(env, 'DB_STEP', '0'),
    // a ramp (overload): [[target rate, seconds], ...] from DB_RATE; empty = constant DB_RATE
    stages: json(env, 'DB_STAGES', []),
    outputSpread: num(env, 'DB_OUTPUT_SPREAD', 0),
    tags: json(env, 'DB_TAGS', {}),
    promptTokens: num(env, 'DB_PROMPT_TOKENS', 200),
    outputTokens: num(env, 'DB_OUTPUT_TOKENS', 64),
    prompts: num(env, 'DB_PROMPTS', 256),
    seed: num(env, 'DB_SEED', 0),
    stream: bool(env, 'DB_STREAM', false),
    ignoreEos: bool(env, 'DB_IGNORE_EOS', true),
    timeoutS: num(env, 'DB_TIMEOUT_S', 30),
    p99Ms: num(env, 'DB_SLO_P99_MS', 2000),
    maxErrorRate: num(env, 'DB_SLO_MAX_ERROR_RATE', 0.01),
    // the workload's plan (deploybench.workloads.Plan.write): each request's lengths and prefix group, and with
    // timed arrivals (poisson, gamma) its send time; empty = the prompt set of lib/prompts.js (by hand)
    plan: str(env, 'DB_PLAN', ''),
    timed: bool(env, 'DB_PLAN_TIMED', false),
    // a timed request that could not start within this long of its send time (every VU busy) is dropped, as
    // constant-arrival-rate drops an iteration it has no VU for
    dropLagMs: num(env, 'DB_DROP_LAG_MS', 1000),
    // timed: how many requests the plan holds (the scenario's iterations)
    planned: num(env, 'DB_PLANNED', 0),
    // several generators (deploybench.load.loadgen): the barrier every one starts its scenario at (epoch ms; setup()
    // sleeps until then), and how many split the phase by execution segments (a timed plan's VUs are rounded up to
    // a multiple of it: k6 splits shared-iterations' iterations as it splits their VUs)
    startAtMs: num(env, 'DB_START_AT_MS', 0),
    generators: num(env, 'DB_GENERATORS', 1),
    // targets that grow during the run (scale-up under load, deploybench.load.scale_up): a page listing them as
    // DB_ENDPOINTS does, re-read by each VU at most every DB_TARGETS_EVERY_MS; empty = DB_ENDPOINTS throughout
    targetsUrl: str(env, 'DB_TARGETS_URL', ''),
    targetsEveryMs: num(env, 'DB_TARGETS_EVERY_MS', 250),
  };
  if (cfg.rate <= 0) throw new Error(`DB_RATE=${cfg.rate} must be > 0 requests/s`);
  if (cfg.durationS <= 0) throw new Error(`DB_DURATION_S=${cfg.durationS} must be > 0`);
  if (cfg.warmupS < 0) throw new Error(`DB_WARMUP_S=${cfg.warmupS} must be >= 0`);
  if (cfg.maxVUs <= 0) cfg.maxVUs = Math.max(2, Math.ceil(cfg.rate * 2));
  if (cfg.preVUs <= 0 || cfg.preVUs > cfg.maxVUs) cfg.preVUs = cfg.maxVUs;
  if (!Array.isArray(cfg.stages)) throw new Error('DB_STAGES must be a JSON list of [rate, seconds]');
  for (const st of cfg.stages) {
    if (!Array.isArray(st) || st.length !== 2 || !(st[0] >= 0) || !(st[1] > 0)) {
      throw new Error(`DB_STAGES entry ${JSON.stringify(st)} must be [rate >= 0, seconds > 0]`);
    }
  }
  if (cfg.stages.length) cfg.durationS = cfg.stages.reduce((a, st) => a + st[1], 0);
  if (cfg.outputSpread < 0 || cfg.outputSpread >= 1) throw new Error(`DB_OUTPUT_SPREAD=${cfg.outputSpread} must be in [0, 1)`);
  if (typeof cfg.tags !== 'object' || Array.isArray(cfg.tags)) throw new Error('DB_TAGS must be a JSON object');
  if (cfg.timed && !cfg.plan) throw new Error('DB_PLAN_TIMED needs DB_PLAN (the plan with the send times)');
  if (!(cfg.startAtMs >= 0)) throw new Error(`DB_START_AT_MS=${cfg.startAtMs} must be an epoch time in ms (0: none)`);
  if (!Number.isInteger(cfg.generators) || cfg.generators < 1) throw new Error(`DB_GENERATORS=${cfg.generators} must be an integer >= 1`);
  if (cfg.timed && !(cfg.planned >= 1)) throw new Error(`DB_PLANNED=${cfg.planned} must be >= 1 with DB_PLAN_TIMED`);
  return cfg;
}

// k6 wants durations as strings; whole milliseconds keep fractional seconds exact enough.
export function ms(seconds) {
  return `${Math.max(1, Math.round(seconds * 1000))}ms`;
}

// constant-arrival-rate takes an integer rate per timeUnit; a fractional rate becomes N per 1000 s.
export function arrival(rate) {
  if (Number.isInteger(rate)) return { rate, timeUnit: '1s' };
  return { rate: Math.round(rate * 1000), timeUnit: '1000s' };
}

// The load shape as a k6 scenario: constant-arrival-rate, or ramping-arrival-rate when stages are set.
// Rates are per 1000 s so that fractional rates stay exact.
export function scenario(cfg) {
  if (cfg.timed) {
    // send times from the plan: every VU takes the next request and sleeps until it is due (run.js), so a request
    // waits for a VU only when all of them hold one in flight; the executor's own pacing plays no part
    const g = cfg.generators;
    return {
      executor: 'shared-iterations', vus: Math.min(cfg.planned, Math.ceil(Math.min(cfg.maxVUs, cfg.planned) / g) * g),
      iterations: cfg.planned,
      maxDuration: ms(cfg.warmupS + cfg.durationS + cfg.timeoutS + 5),
    };
  }
  if (!cfg.stages.length) {
    const { rate, timeUnit } = arrival(cfg.rate);
    return { executor: 'constant-arrival-rate', rate, timeUnit, duration: ms(cfg.warmupS + cfg.durationS) };
  }
  const stages = [];
  if (cfg.warmupS > 0) stages.push({ target: Math.round(cfg.rate * 1000), duration: ms(cfg.warmupS) });
  for (const [target, seconds] of cfg.stages) stages.push({ target: Math.round(target * 1000), duration: ms(seconds) });
  return { executor: 'ramping-arrival-rate', startRate: Math.round(cfg.rate * 1000), timeUnit: '1000s', stages };
}

// When iteration i (0-based, in start order) was due, in ms after the scenario start: the inverse of
// the integral of the rate over time (piecewise linear, as k6 ramps it). Its difference to the
// actual start is the schedule lag; after a dropped iteration it is over-stated.
export function scheduledMs(cfg, i) {
  const segs = [];
  if (cfg.timed) throw new Error('a timed plan carries its own send times');
  if (!cfg.stages.length) return (1000 * i) / cfg.rate;
  let from = cfg.rate;
  if (cfg.warmupS > 0) segs.push([cfg.rate, cfg.rate, cfg.warmupS]);
  for (const [target, seconds] of cfg.stages) {
    segs.push([from, target, seconds]);
    from = target;
  }
  let t = 0;
  let left = i;
  for (const [a, b, d] of segs) {
    const n = ((a + b) / 2) * d; // iterations in this segment
    if (left <= n) {
      const k = (b - a) / d; // rate slope per second
      const s = Math.abs(k) < 1e-12 ? left / a : (-a + Math.sqrt(Math.max(0, a * a + 2 * k * left))) / k;
      return 1000 * (t + s);
    }
    left -= n;
    t += d;
  }
  return 1000 * t;
}
