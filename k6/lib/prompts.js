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

// Request i of a workload's plan (deploybench.workloads.Plan): [send ms or -1, own tokens, output tokens, group].
// Its own words come from a stream seeded by (plan seed, i), so every request differs and a rerun repeats them; a
// request of a prefix group starts with that group's text (plan.prefixes), which every client sends identically.
// Returns {text, prefix, own, tokens, maxTokens}: text = prefix + ' ' + own words (own words alone without one).
export function planPrompt(req, prefixes, prefixTokens, seed, i) {
  const next = rng((seed ^ Math.imul(i + 1, 0x9e3779b1)) >>> 0);
  const own = new Array(req[1]);
  for (let w = 0; w < req[1]; w++) own[w] = WORDS[Math.floor(next() * WORDS.length)];
  const ownText = own.join(' ');
  const prefix = req[3] >= 0 ? prefixes[req[3]] : '';
  return {
    text: prefix ? `${prefix} ${ownText}` : ownText,
    prefix,
    own: ownText,
    tokens: req[1] + (prefix ? prefixTokens : 0),
    maxTokens: req[2],
  };
}
