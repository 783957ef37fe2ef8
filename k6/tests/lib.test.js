// Checks of k6/lib that need no server: run by tests/unit/load/test_load_k6lib.py with the real k6.
// Every check must pass (thresholds: checks rate==1); a failed check exits 99.
import { check } from 'k6';
import { arrival, loadConfig, ms, scenario, scheduledMs } from '../lib/config.js';
import { blockText, makePrompts, planConversation, turnPrompt } from '../lib/prompts.js';
import { buildRequest, errorKind, parseSSE, readResponse } from '../lib/requests.js';

export const options = { iterations: 1, vus: 1, thresholds: { checks: ['rate==1'] } };

const EP = { node: 'n1', url: 'http://127.0.0.1:9', model: 'sim-model' };
const base = { DB_ENDPOINTS: JSON.stringify([EP]), DB_RATE: '2.5', DB_DURATION_S: '6' };

function throws(fn) {
  try {
    fn();
    return false;
  } catch (e) {
    return true;
  }
}

export default function () {
  const cfg = loadConfig(Object.assign({}, base, { DB_OUTPUT_TOKENS: '16' }));
  check(cfg, {
    'config: defaults': (c) => c.api === 'completions' && c.warmupS === 0 && c.stream === false && c.phase === 'sustained',
    'config: numbers parsed': (c) => c.rate === 2.5 && c.durationS === 6 && c.outputTokens === 16,
  });
  check(null, {
    'config: missing endpoints throws': () => throws(() => loadConfig({ DB_RATE: '1', DB_DURATION_S: '1' })),
    'config: bad rate throws': () => throws(() => loadConfig(Object.assign({}, base, { DB_RATE: 'fast' }))),
    'config: unknown api throws': () => throws(() => loadConfig(Object.assign({}, base, { DB_API: 'grpc' }))),
    'config: fractional rate per 1000s': () => arrival(2.5).rate === 2500 && arrival(2.5).timeUnit === '1000s',
    'config: integer rate per second': () => arrival(20).rate === 20 && arrival(20).timeUnit === '1s',
    'config: ms': () => ms(1.5) === '1500ms',
  });

  const ramp = loadConfig(Object.assign({}, base, { DB_RATE: '10', DB_WARMUP_S: '2', DB_STAGES: '[[30, 4], [5, 0.001], [5, 3]]' }));
  const sc = scenario(ramp);
  const flat = loadConfig(Object.assign({}, base, { DB_RATE: '10', DB_WARMUP_S: '1' }));
  check(null, {
    'shape: constant rate': () => scenario(flat).executor === 'constant-arrival-rate' && scenario(flat).duration === '7000ms',
    'shape: ramp with warm-up stage': () =>
      sc.executor === 'ramping-arrival-rate' && sc.startRate === 10000 && sc.stages.length === 4 &&
      sc.stages[1].target === 30000 && sc.stages[1].duration === '4000ms',
    'shape: ramp duration is the stages': () => Math.abs(ramp.durationS - 7.001) < 1e-9,
    'shape: bad stage throws': () => throws(() => loadConfig(Object.assign({}, base, { DB_STAGES: '[[5]]' }))),
    'schedule: constant': () => scheduledMs(flat, 25) === 2500,
    // 20 iterations in the 2 s warm-up at 10/s; then the rate climbs 5/s per s: 10 t + 2.5 t^2 = 30 at t = 2
    'schedule: ramp': () => scheduledMs(ramp, 20) === 2000 && Math.abs(scheduledMs(ramp, 50) - 4000) < 1e-6,
  });

  const spread = makePrompts(400, 50, 3, 100, 0.5);
  const outs = spread.map((p) => p.maxTokens);
  const outMean = outs.reduce((x, y) => x + y, 0) / outs.length;
  check(null, {
    'prompts: output spread within [0.5, 1.5] x target': () => Math.min(...outs) >= 50 && Math.max(...outs) <= 150,
    'prompts: output mean near target': () => Math.abs(outMean - 100) < 6,
    'prompts: fixed output without spread': () => makePrompts(10, 50, 3, 16, 0).every((p) => p.maxTokens === 16),
    'prompts: output spread leaves the prompts alone': () => makePrompts(5, 50, 3)[4].text === spread[4].text,
  });

  const a = makePrompts(200, 100, 7);
  const b = makePrompts(200, 100, 7);
  const c = makePrompts(200, 100, 8);
  const lens = a.map((p) => p.tokens);
  const mean = lens.reduce((x, y) => x + y, 0) / lens.length;
  check(null, {
    'prompts: same seed, same prompts': () => a.every((p, i) => p.text === b[i].text),
    'prompts: other seed, other prompts': () => a.some((p, i) => p.text !== c[i].text),
    'prompts: word count = tokens': () => a.every((p) => p.text.split(' ').length === p.tokens),
    'prompts: lengths within [0.5, 1.5] x target': () => Math.min(...lens) >= 50 && Math.max(...lens) <= 150,
    'prompts: mean near target': () => Math.abs(mean - 100) < 8,
    'prompts: spread': () => Math.max(...lens) - Math.min(...lens) > 60,
  });

  const prompt = a[0];
  const comp = buildRequest(cfg, EP, prompt);
  const compBody = JSON.parse(comp.body);
  const chat = buildRequest(Object.assign({}, cfg, { api: 'chat', stream: true }), EP, prompt);
  const chatBody = JSON.parse(chat.body);
  const tri = buildRequest(Object.assign({}, cfg, { api: 'triton' }), EP, prompt);
  check(null, {
    'build: completions url and body': () =>
      comp.url === 'http://127.0.0.1:9/v1/completions' && compBody.prompt === prompt.text &&
      compBody.max_tokens === 16 && compBody.model === 'sim-model' && compBody.stream === false,
    'build: chat stream url and body': () =>
      chat.url === 'http://127.0.0.1:9/v1/chat/completions' && chatBody.messages[0].content === prompt.text &&
      chatBody.stream === true && chatBody.stream_options.include_usage === true,
    'build: triton generate': () =>
      tri.url === 'http://127.0.0.1:9/v2/models/sim-model/generate' &&
      JSON.parse(tri.body).parameters.max_tokens === 16,
    // vllm_backend src/utils/request.py: stream is an input, not a parameter; the prompt is left out of the
    // answer only when exclude_input_in_output is set; the token counts come back when asked for
    'build: triton inputs and parameters as the vLLM backend reads them': () => {
      const b = JSON.parse(tri.body);
      const s = JSON.parse(buildRequest(Object.assign({}, cfg, { api: 'triton', stream: true }), EP, prompt).body);
      return b.text_input === prompt.text && b.stream === false && s.stream === true &&
        b.exclude_input_in_output === true && b.return_num_output_tokens === true &&
        b.parameters.stream === undefined && b.parameters.temperature === 0;
    },
  });

  const sse =
    'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":" b"}]}\r\n\r\n: keep-alive\n\n' +
    'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\ndata: [DONE]\n\n';
  const chatSse = 'data: {"choices":[{"delta":{"content":"x"}}]}\n\ndata: {"choices":[{"delta":{"content":"y"}}]}\n\n';
  const s1 = parseSSE(sse);
  const s2 = parseSSE(chatSse);
  const streamCfg = Object.assign({}, cfg, { stream: true });
  check(null, {
    'sse: chunks, usage, done': () => s1.chunks === 2 && s1.done && s1.usage.completion_tokens === 2 && s1.text === 'a b',
    'sse: chat deltas counted, no done': () => s2.chunks === 2 && !s2.done,
    'read: stream with usage': () => {
      const r = readResponse(streamCfg, { body: sse }, prompt);
      return r.ok && r.outputTokens === 2 && r.promptTokens === 9;
    },
    'read: stream without [DONE] is an error': () =>
      readResponse(streamCfg, { body: chatSse }, prompt).errorKind === 'stream_incomplete',
    'read: json usage': () => {
      const body = JSON.stringify({ choices: [{ text: 'hi' }], usage: { prompt_tokens: 5, completion_tokens: 16 } });
      const r = readResponse(cfg, { body }, prompt);
      return r.ok && r.outputTokens === 16 && r.promptTokens === 5 && r.tokensFrom === 'usage';
    },
    'read: stream without usage counts its text events and says so': () => {
      const body = 'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n' +
        'data: {"choices":[{"text":"c"}]}\n\ndata: [DONE]\n\n';
      const r = readResponse(streamCfg, { body }, prompt);
      return r.ok && r.outputTokens === 3 && r.tokensFrom === 'stream';
    },
    'read: json without usage counts words and says so': () => {
      const r = readResponse(cfg, { body: JSON.stringify({ choices: [{ text: 'one two three four' }] }) }, prompt);
      return r.ok && r.outputTokens === 4 && r.tokensFrom === 'text';
    },
    'read: json without choices is bad_response': () =>
      readResponse(cfg, { body: JSON.stringify({ usage: { completion_tokens: 3 } }) }, prompt).errorKind === 'bad_response',
    'read: triton generate counts the backend\'s tokens, not the words': () => {
      const tcfg = Object.assign({}, cfg, { api: 'triton' });
      const counted = readResponse(tcfg, { body: JSON.stringify({ text_output: 'a b c', num_output_tokens: 16,
        num_input_tokens: [7] }) }, prompt);
      const words = readResponse(tcfg, { body: JSON.stringify({ text_output: 'a b c' }) }, prompt);
      return counted.ok && counted.outputTokens === 16 && counted.promptTokens === 7 &&
        counted.tokensFrom === 'usage' && words.outputTokens === 3 && words.tokensFrom === 'text';
    },
    'read: triton stream sums the per-response counts': () => {
      const body = 'data: {"text_output":"a","num_output_tokens":1}\n\ndata: {"text_output":" b c",' +
        '"num_output_tokens":[2]}\n\n';
      const r = readResponse(Object.assign({}, cfg, { api: 'triton', stream: true }), { body }, prompt);
      return r.ok && r.outputTokens === 3 && r.tokensFrom === 'usage';
    },
    'read: bad json is bad_response': () => readResponse(cfg, { body: '<html>' }, prompt).errorKind === 'bad_response',
    'error kinds': () =>
      errorKind({ status: 503 }) === 'http_503' && errorKind({ status: 0, error_code: 1050 }) === 'timeout' &&
      errorKind({ status: 0, error_code: 1220 }) === 'connection_reset' &&
      errorKind({ status: 0, error_code: 1212 }) === 'connection_refused' && errorKind({ status: 200 }) === '',
  });

  // a workload plan's request: [send ms, own tokens, output tokens, prefix group, text, system, blocks, later turns]
  const head = { seed: 42, prefixes: ['g0 the of and', 'g1 to in is'], prefixTokens: 4, texts: ['hello there', 'be brief'],
    textTokens: [2, 2], blockTokens: 4 };
  const c0 = planConversation([-1, 5, 7, 1, -1, -1, 0, 0], head, 0);
  const c1 = planConversation([-1, 5, 7, 1, -1, -1, 0, 0], head, 1);
  const lone = planConversation([-1, 6, 3, -1, -1, -1, 0, 0], head, 0);
  const talk = planConversation([-1, 2, 3, -1, 0, 1, 0, [[4, 5, 1500, -1], [2, 2, 0, 0]]], head, 3);
  const traced = planConversation([-1, 6, 2, -1, -1, -1, [7, 9], 0], head, 0);
  const p0 = turnPrompt(c0, c0.turns[0], [], 0);
  const hist = [{ role: 'user', content: 'hello there' }, { role: 'assistant', content: ' a b c' }];
  const later = turnPrompt(talk, talk.turns[1], hist, 5);
  const chatCfg = Object.assign({}, loadConfig(base), { api: 'chat' });
  const timed = loadConfig(Object.assign({}, base, { DB_PLAN: '/x.json', DB_PLAN_TIMED: 'true', DB_PLANNED: '40',
    DB_WARMUP_S: '1', DB_MAX_VUS: '12' }));
  check(null, {
    'plan: prefix then own words, counted': () => p0.text.startsWith('g1 to in is ') && p0.tokens === 9 &&
      p0.own.split(' ').length === 5 && p0.maxTokens === 7,
    'plan: each request its own words': () => c0.turns[0].user !== c1.turns[0].user && c0.system === c1.system,
    'plan: the same request twice, the same words': () =>
      planConversation([-1, 5, 7, 1, -1, -1, 0, 0], head, 0).turns[0].user === c0.turns[0].user,
    'plan: no prefix group, no system prompt': () => lone.system === '' && lone.systemTokens === 0 &&
      turnPrompt(lone, lone.turns[0], [], 0).text === lone.turns[0].user,
    'plan: chat sends the prefix as the system message': () => {
      const m = JSON.parse(buildRequest(chatCfg, EP, p0).body).messages;
      return m.length === 2 && m[0].role === 'system' && m[0].content === head.prefixes[1] && m[1].content === p0.own;
    },
    'plan: a dataset text and system prompt': () => talk.turns[0].user === 'hello there' && talk.system === 'be brief' &&
      talk.systemTokens === 2 && talk.turns.length === 3 && talk.turns[2].user === 'hello there',
    'plan: a later turn waits its think time and carries the conversation': () => {
      const m = JSON.parse(buildRequest(chatCfg, EP, later).body).messages;
      return talk.turns[1].thinkMs === 1500 && later.tokens === 2 + 5 + 4 && m.length === 4 && m[0].role === 'system' &&
        m[2].role === 'assistant' && m[2].content === ' a b c' && m[3].content === talk.turns[1].user;
    },
    'plan: completions get the conversation as one text': () =>
      JSON.parse(buildRequest(loadConfig(base), EP, later).body).prompt === `be brief hello there  a b c ${talk.turns[1].user}`,
    'plan: trace blocks, the last one cut': () => traced.turns[0].user.split(' ').length === 6 &&
      traced.turns[0].user.startsWith(blockText([7], 4, 4)) && blockText([7], 4, 4) === blockText([7], 4, 4) &&
      blockText([7], 4, 4) !== blockText([9], 4, 4) && blockText([7], 4, 4, 5) !== blockText([7], 4, 4, 6),
    // deploybench.workloads.block_text, computed by the Python test that runs this file
    'plan: block words as Python makes them': () => !__ENV.DB_TEST_BLOCK_TEXT ||
      blockText([3, 11], 600, 512, 987654321) === __ENV.DB_TEST_BLOCK_TEXT,
    'plan: timed is shared-iterations over the planned requests': () => {
      const sc = scenario(timed);
      return sc.executor === 'shared-iterations' && sc.iterations === 40 && sc.vus === 12 && sc.maxDuration === '42000ms';
    },
    'plan: timed without a count throws': () =>
      throws(() => loadConfig(Object.assign({}, base, { DB_PLAN: '/x.json', DB_PLAN_TIMED: 'true' }))),
  });
}
