"""A tiny Llama-architecture GGUF model with random weights, written here (no download), for llama.cpp.

The vocabulary is SentencePiece-style ("llama" tokenizer): the control tokens, the 256 byte-fallback
tokens, and "▁word" for every word the load generators' prompts are made of (k6/lib/prompts.js,
deploybench.load.ttft.WORDS), so one prompt word is one token, as the load stage assumes. The end of
sequence token's output row (and those of the other control and byte tokens) is zero while every word's
row is random, so greedy decoding (temperature 0) practically never ends early and never emits a
partial UTF-8 byte: every answer has max_tokens tokens, each streamed as one event with text, as with
vLLM's ignore_eos.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deploybench.load.ttft import WORDS


def write_tiny_llama(path: Path, n_embd: int = 384, n_layer: int = 4, n_ff: int = 1024, n_head: int = 4,
                     ctx: int = 1024, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    words = sorted(set(WORDS)) + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens += ["\u2581" + w for w in words] + [w for w in words]
    types += [gguf.TokenType.NORMAL] * (2 * len(words))
    scores = [0.0] * 259 + [-float(i) for i in range(2 * len(words))]
    n_vocab = len(tokens)

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("deploybench-tiny-random")
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    def t(name: str, *shape: int, scale: float = 0.05) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", n_vocab, n_embd, scale=1.0)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    out = (rng.standard_normal((n_vocab, n_embd)) * 0.05).astype(np.float32)
    out[:259] = 0.0  # </s>, <unk>, <s> and the byte tokens never win a greedy step
    w.add_tensor("output.weight", out)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"blk.{i}.{name}.weight", n_embd, n_embd)
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
