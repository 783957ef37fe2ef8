// A deterministic prompt set, generated from a seed: no download, the same prompts on every run.
//
// Lengths are spread uniformly over [0.5, 1.5] x the target length (mean = the target), so a run
// exercises short and long prefills alike. A prompt is built from short common English words, which
// most tokenizers encode as one token each (with the leading space), so the word count is a fair
// estimate of the prompt tokens; the server's own usage.prompt_tokens is preferred when it answers.

const WORDS = (
  'the of and to in is it you that he was for on are as with his they at be this have from or one ' +
  'had by word but not what all were we when your can said there use an each which she do how their ' +
  'if will up other about out many then them these so some her would make like him into time has ' +
  'look two more write go see number no way could people my than first water been call who oil its ' +
  'now find long down day did get come made may part'
).split(' ');

// mulberry32: a small, well-mixed 32-bit PRNG; the same seed gives the same sequence in any k6.
export function rng(seed) {
  let a = seed >>> 0;
  return function next() {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Returns [{text, tokens, maxTokens}] with `count` prompts whose lengths average `meanTokens`; the
// output length asked for averages `outTokens`, spread uniformly over [1 - outSpread, 1 + outSpread]
// x `outTokens` (drawn from a second stream, so the prompts do not change with the output spread).
export function makePrompts(count, meanTokens, seed, outTokens = 0, outSpread = 0) {
  const next = rng(seed);
  const nextOut = rng(seed ^ 0x5bd1e995);
  const out = [];
  for (let i = 0; i < count; i++) {
    const tokens = Math.max(1, Math.round(meanTokens * (0.5 + next())));
    const words = new Array(tokens);
    for (let w = 0; w < tokens; w++) words[w] = WORDS[Math.floor(next() * WORDS.length)];
    const draw = nextOut();
    const maxTokens = outTokens > 0 ? Math.max(1, Math.round(outTokens * (1 - outSpread + 2 * outSpread * draw))) : 0;
    out.push({ text: words.join(' '), tokens, maxTokens });
  }
  return out;
}

// A trace block's words: block d (a dense id) is `blockTokens` words from a stream seeded by d and the run's salt,
// so one id is one text wherever it appears in a run, and another run's words differ (a warm engine must not find
// an earlier run's blocks); deploybench.workloads.block_text makes the same. A request's last block is cut.
const blockCache = new Map();
function blockWords(d, blockTokens, salt) {
  const key = `${salt}:${d}`;
  let words = blockCache.get(key);
  if (!words) {
    const next = rng(((Math.imul(d, 0x9e3779b1) + 0x7f4a7c15) ^ salt) >>> 0);
    words = new Array(blockTokens);
    for (let w = 0; w < blockTokens; w++) words[w] = WORDS[Math.floor(next() * WORDS.length)];
    if (blockCache.size > 4096) blockCache.clear(); // a VU keeps the blocks it met lately, not a whole trace
    blockCache.set(key, words);
  }
  return words;
}

export function blockText(blocks, tokens, blockTokens, salt = 0) {
  const out = [];
  for (let j = 0; j < blocks.length; j++) {
    const n = Math.min(blockTokens, tokens - j * blockTokens);
    if (n > 0) out.push(blockWords(blocks[j], blockTokens, salt).slice(0, n).join(' '));
  }
  return out.join(' ');
}

// Request i of a workload's plan (deploybench.workloads.Plan.write), a conversation of one turn or more:
//   [send ms or -1, own tokens, output tokens, prefix group, text, system, blocks or 0, later turns or 0]
// with later turns [own tokens, output tokens, think ms, text]. A turn's words are the plan's text (a dataset's),
// else its trace blocks, else made from a stream seeded by (plan seed, the run's salt, i, turn): every request
// differs, a rerun of the same run repeats them, and another run's differ (so a warm engine finds none of them).
// The system prompt is the request's shared prefix (which every client sends identically) and/or its dataset
// system prompt. Returns {system, systemTokens, turns: [{user, tokens, maxTokens, thinkMs}]}.
export function planConversation(req, head, i) {
  const sys = [];
  let systemTokens = 0;
  if (req[3] >= 0) {
    sys.push(head.prefixes[req[3]]);
    systemTokens += head.prefixTokens;
  }
  if (req[5] >= 0) {
    sys.push(head.texts[req[5]]);
    systemTokens += head.textTokens[req[5]];
  }
  const all = [[req[1], req[2], 0, req[4]]].concat(req[7] || []);
  const turns = all.map(([own, out, think, text], t) => {
    let user;
    if (text >= 0) user = head.texts[text];
    else if (req[6] && t === 0) user = blockText(req[6], own, head.blockTokens, head.salt || 0);
    else {
      const mix = head.seed ^ (head.salt || 0) ^ Math.imul(i + 1, 0x9e3779b1) ^ Math.imul(t, 0x85ebca6b);
      const next = rng(mix >>> 0);
      const words = new Array(own);
      for (let w = 0; w < own; w++) words[w] = WORDS[Math.floor(next() * WORDS.length)];
      user = words.join(' ');
    }
    return { user, tokens: own, maxTokens: out, thinkMs: think };
  });
  return { system: sys.join(' '), systemTokens, turns };
}

// One turn as buildRequest takes it: the conversation so far (`history`: [{role, content}]) then `user`.
export function turnPrompt(conv, turn, history, historyTokens) {
  const parts = [conv.system].concat(history.map((m) => m.content), [turn.user]).filter((x) => x);
  return {
    text: parts.join(' '), prefix: conv.system, own: turn.user, history,
    tokens: conv.systemTokens + historyTokens + turn.tokens, maxTokens: turn.maxTokens,
  };
}
