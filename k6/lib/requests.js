// Request building and response reading for the APIs deploybench drives:
//   completions  OpenAI /v1/completions      (vLLM, the simulated engine)
//   chat         OpenAI /v1/chat/completions (vLLM, the simulated engine)
//   triton       Triton /v2/models/<model>/generate[_stream]
//
// k6's HTTP client buffers the whole body, also for a streamed (SSE) answer, so a stream is read after
// the fact: its chunks are counted and the closing [DONE] is checked. Nothing here measures time to
// first token (k6 cannot see it; timings.waiting is the time to the response headers).

export function buildRequest(cfg, endpoint, prompt) {
  const maxTokens = prompt.maxTokens || cfg.outputTokens;
  const headers = { 'Content-Type': 'application/json' };
  if (cfg.stream) headers.Accept = 'text/event-stream';
  if (cfg.api === 'triton') {
    return { url: tritonUrl(endpoint, cfg.stream), body: JSON.stringify(tritonBody(prompt.text, maxTokens, cfg)), headers };
  }
  const payload = { model: endpoint.model, max_tokens: maxTokens, temperature: 0, stream: cfg.stream };
  if (cfg.ignoreEos) payload.ignore_eos = true; // vLLM extension: always produce max_tokens
  if (cfg.stream) payload.stream_options = { include_usage: true };
  if (cfg.api === 'chat') {
    // a shared prefix is the conversation's system prompt (what an application shares between its users); a
    // later turn of a conversation carries the turns before it, the answers included
    payload.messages = (prompt.prefix ? [{ role: 'system', content: prompt.prefix }] : [])
      .concat(prompt.history || [])
      .concat([{ role: 'user', content: prompt.own !== undefined ? prompt.own : prompt.text }]);
    return { url: `${endpoint.url}/v1/chat/completions`, body: JSON.stringify(payload), headers };
  }
  payload.prompt = prompt.text;
  return { url: `${endpoint.url}/v1/completions`, body: JSON.stringify(payload), headers };
}

// Triton's generate extension: the body's top-level keys are the model's inputs, "parameters" the request's
// parameters. Triton's vLLM backend (triton-inference-server/vllm_backend src/utils/request.py) reads `stream`
// as an input, returns the prompt in front of a non-streamed answer unless `exclude_input_in_output`, counts
// the tokens it made when asked (`return_num_output_tokens`: per response, so a stream's are summed) and takes
// its sampling parameters (max_tokens, ignore_eos, temperature) from the request's parameters.
export function tritonUrl(endpoint, stream) {
  return `${endpoint.url}/v2/models/${encodeURIComponent(endpoint.model)}/${stream ? 'generate_stream' : 'generate'}`;
}

export function tritonBody(text, maxTokens, cfg) {
  const parameters = { max_tokens: maxTokens, temperature: 0 };
  if (cfg.ignoreEos) parameters.ignore_eos = true;
  return {
    text_input: text, stream: !!cfg.stream, exclude_input_in_output: true,
    return_num_input_tokens: true, return_num_output_tokens: true, parameters,
  };
}

// A count Triton returned: a one-element tensor comes as a number or as a list of one.
function tritonCount(v) {
  const n = Array.isArray(v) ? v[0] : v;
  return typeof n === 'number' && isFinite(n) && n >= 0 ? n : null;
}

// Paths that answer 200 when an endpoint can take requests, tried in order.
export function readinessPaths(api) {
  return api === 'triton' ? ['/v2/health/ready'] : ['/health', '/v1/models'];
}

function wordCount(text) {
  const t = String(text || '').trim();
  return t ? t.split(/\s+/).length : 0;
}

// Parses an SSE body: {chunks, done, usage, text}. Tolerates "data:" with or without a space and
// CRLF line ends; ignores comments and other fields.
export function parseSSE(body) {
  const out = { chunks: 0, done: false, usage: null, text: '', bad: 0, tritonTokens: null, tritonPrompt: null };
  for (const raw of String(body || '').split('\n')) {
    const line = raw.replace(/\r$/, '');
    if (!line.startsWith('data:')) continue;
    const data = line.slice(5).trim();
    if (data === '[DONE]') {
      out.done = true;
      continue;
    }
    if (!data) continue;
    let evt;
    try {
      evt = JSON.parse(data);
    } catch (e) {
      out.bad += 1;
      continue;
    }
    if (evt.usage) out.usage = evt.usage;
    if (evt.text_output !== undefined) {
      out.chunks += 1;
      out.text += evt.text_output;
      const n = tritonCount(evt.num_output_tokens);
      if (n !== null) out.tritonTokens = (out.tritonTokens || 0) + n;
      const p = tritonCount(evt.num_input_tokens);
      if (p !== null) out.tritonPrompt = p;
      continue;
    }
    const choice = (evt.choices || [])[0];
    if (!choice) continue;
    const piece = choice.text !== undefined ? choice.text : choice.delta && choice.delta.content;
    if (piece) {
      out.chunks += 1;
      out.text += piece;
    }
  }
  return out;
}

// Reads a 2xx answer: {ok, errorKind, promptTokens, outputTokens, tokensFrom, text (the answer: a conversation's
// next turn carries it)}. A 2xx whose body cannot be
// read (bad JSON, a stream without [DONE]) is an error of its own kind, not a success. tokensFrom says
// where outputTokens came from: 'usage' (the server's count), 'stream' (text events counted: servers
// such as llama.cpp's send no usage in a stream) or 'text' (words of an answer without usage).
export function readResponse(cfg, res, prompt) {
  const r = { ok: true, errorKind: '', promptTokens: prompt.tokens, outputTokens: 0, tokensFrom: 'usage', text: '' };
  if (cfg.stream) {
    const sse = parseSSE(res.body);
    if (cfg.api !== 'triton' && !sse.done) return { ...r, ok: false, errorKind: 'stream_incomplete' };
    if (sse.chunks === 0 && !sse.usage) return { ...r, ok: false, errorKind: 'bad_response' };
    r.text = sse.text;
    if (sse.usage) {
      r.outputTokens = sse.usage.completion_tokens || 0;
      r.promptTokens = sse.usage.prompt_tokens || r.promptTokens;
    } else if (sse.tritonTokens !== null) {
      r.outputTokens = sse.tritonTokens; // the vLLM backend's own count (return_num_output_tokens)
      r.promptTokens = sse.tritonPrompt || r.promptTokens;
    } else {
      r.outputTokens = cfg.api === 'triton' ? Math.max(sse.chunks, wordCount(sse.text)) : sse.chunks;
      r.tokensFrom = 'stream';
    }
    return r;
  }
  let data;
  try {
    data = JSON.parse(res.body);
  } catch (e) {
    return { ...r, ok: false, errorKind: 'bad_response' };
  }
  if (cfg.api === 'triton') {
    if (typeof data.text_output !== 'string') return { ...r, ok: false, errorKind: 'bad_response' };
    r.text = data.text_output;
    const n = tritonCount(data.num_output_tokens);
    if (n !== null) {
      r.outputTokens = n; // the vLLM backend's count; the text is the answer alone (exclude_input_in_output)
      r.promptTokens = tritonCount(data.num_input_tokens) || r.promptTokens;
      return r;
    }
    r.outputTokens = wordCount(data.text_output); // a backend that does not count: the answer's words
    r.tokensFrom = 'text';
    return r;
  }
  if (!Array.isArray(data.choices) || !data.choices.length) return { ...r, ok: false, errorKind: 'bad_response' };
  const first = data.choices[0] || {};
  const said = first.text !== undefined ? first.text : first.message && first.message.content;
  r.text = typeof said === 'string' ? said : '';
  if (!data.usage) {
    const c = data.choices[0] || {};
    r.outputTokens = wordCount(c.text !== undefined ? c.text : c.message && c.message.content);
    r.tokensFrom = 'text';
    return r;
  }
  r.outputTokens = data.usage.completion_tokens || 0;
  r.promptTokens = data.usage.prompt_tokens || r.promptTokens;
  return r;
}

// k6 error codes (https://grafana.com/docs/k6/latest/javascript-api/error-codes/) folded into kinds.
export function errorKind(res) {
  if (res.status >= 400) return `http_${res.status}`;
  if (res.status > 0) return '';
  switch (res.error_code) {
    case 1050:
      return 'timeout';
    case 1211:
      return 'connect_timeout';
    case 1212:
      return 'connection_refused';
    case 1201:
    case 1220:
      return 'connection_reset';
    default:
      return res.error_code ? `network_${res.error_code}` : 'network';
  }
}
