// The per-request sample.
//
// k6 has no file API, so every request is recorded as one point of the custom Trend `db_request`
// (value = end-to-end latency in ms), which `--out json=...` writes with its tags and metadata:
//   tags (low cardinality, sub-metrics and thresholds can select them):
//     node, phase, window (warmup|measure), ok (true|false), status, error_kind, plus run tags
//   metadata (per-VU, high cardinality, creates no time series; written by the JSON output as
//   data.metadata, verified with k6 1.1.0):
//     t0 (request start, epoch ms), lag_ms (start - when it was due), prompt_tokens, output_tokens, iter (k6's
//     exec.scenario.iterationInTest, unique across execution segments), and with a
//     workload's plan conv (its request: a conversation) and turn
// deploybench.load parses these points into the samples DataFrame.
import exec from 'k6/execution';
import { Counter, Rate, Trend } from 'k6/metrics';

export const requestTrend = new Trend('db_request', true);
export const requestFailed = new Rate('db_request_failed');
export const outputTokens = new Trend('db_output_tokens');
// where each answer's token count came from (usage | stream | text): the summary export carries the counts
export const tokensFrom = new Counter('db_tokens_from');

// a timed request dropped because no VU was free when it was due (k6's own dropped_iterations counts only the
// arrival-rate executors' drops); deploybench.load.samples reads both
export const dropped = new Counter('db_dropped');

export function recordDropped(window) {
  dropped.add(1, { window });
}

export function recordSample(sample) {
  const md = exec.vu.metrics.metadata;
  md.t0 = String(sample.t0);
  md.lag_ms = String(sample.lagMs);
  md.prompt_tokens = String(sample.promptTokens);
  md.output_tokens = String(sample.outputTokens);
  // k6's index of this iteration in the whole test: with execution segments (several generators) each one's
  // indexes are its own share of 0..N-1, so the merged samples show every iteration sent once
  md.iter = String(exec.scenario.iterationInTest);
  if (sample.conv !== undefined) {
    md.conv = String(sample.conv); // the plan's request (a conversation) and the turn within it
    md.turn = String(sample.turn);
  }
  const tags = {
    node: sample.node,
    window: sample.window,
    ok: sample.ok ? 'true' : 'false',
    status: String(sample.status),
    error_kind: sample.errorKind || '',
  };
  requestTrend.add(sample.latencyMs, tags);
  requestFailed.add(!sample.ok, { node: sample.node, window: sample.window });
  if (sample.ok) {
    outputTokens.add(sample.outputTokens, { node: sample.node, window: sample.window });
    tokensFrom.add(1, { tokens_from: sample.tokensFrom || 'usage' });
  }
  delete md.t0;
  delete md.lag_ms;
  delete md.prompt_tokens;
  delete md.output_tokens;
  delete md.iter;
  delete md.conv;
  delete md.turn;
}
