"""Datasets and traces read as hostile input (deploybench.workloads.sources, .streams, .samples).

Every format is read from small files written here; every refusal is checked for the line it names and its key
words; the reservoir for determinism, file order and uniformity; a 10,000-conversation ShareGPT array for the memory
the streaming reader holds (tracemalloc's peak, printed with the time: `pytest -s` shows both).
"""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

from deploybench import workloads as W
from deploybench.errors import ConfigError
from deploybench.sim.service_model import count_tokens
from deploybench.workloads import samples, streams
from deploybench.workloads import sources as S

MB = 1 << 20


def _write(tmp_path: Path, name: str, data: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def _lines(*records: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _read(path: Path, fmt: str = "jsonl", **kw: int) -> list[S.Conversation]:
    opts = {"sample": 1000, "seed": 0, "max_bytes": 10 * MB, **kw}
    return S.read_dataset(path, fmt, **opts)[0]  # type: ignore[arg-type]


SHAREGPT = [
    {"id": "a_0", "conversations": [
        {"from": "human", "value": 'What does "]}," mean?\n\\ back'},
        {"from": "gpt", "value": "It is three marks: a bracket, a brace and a comma."},
    ]},
    {"id": "b_0", "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "gpt", "value": "Hello, how can I help?"},  # before any human turn: answers nothing sent
        {"from": "human", "value": "caf\u00e9 \u2603 [one"},
        {"from": "chatgpt", "value": "ok"},
        {"from": "bard", "value": "and more"},
        {"from": "user", "value": "two"},
    ]},
    {"conversations": [{"from": "human", "value": ""}, {"from": "bing", "value": ""}]},
]  # fmt: skip
SHAREGPT_WANT = [
    S.Conversation((S.Turn('What does "]}," mean?\n\\ back', 14),)),
    S.Conversation((S.Turn("caf\u00e9 \u2603 [one", 3), S.Turn("two", None)), system="You are terse."),
    S.Conversation((S.Turn("", None),)),  # an empty answer is no answer to size a request by
]


# -- reading --------------------------------------------------------------------------------------------------------
def test_approx_tokens_is_the_simulated_engines_count_and_the_token_bound_is_the_workloads():
    for text in ["", "Hello, world!", "  a  b\n\tc ", "don't stop: 3.14", "caf\u00e9 \u2603 x_y"]:
        assert S.approx_tokens(text) == count_tokens(text)
    assert S.approx_tokens("Hello, world!") == 4
    assert S.MAX_TOKENS == W.MAX_TOKENS


def test_jsonl_prompts_and_chats_give_turns_answer_tokens_and_the_system_prompt(tmp_path):
    path = _write(tmp_path, "d.jsonl", _lines(
        {"prompt": "Say hi.", "output_tokens": 7},
        {"prompt": "No length given."},
        {"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "First?"},
            {"role": "assistant", "content": "One two, three."},
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Second?"},
            {"role": "user", "content": "Third?"},
            {"role": "assistant", "content": "Four words here now"},
        ], "output_tokens": 50, "id": 3},
        {"messages": [{"role": "user", "content": "Only a question"}]},
    ))  # fmt: skip
    assert _read(path) == [
        S.Conversation((S.Turn("Say hi.", 7),)),
        S.Conversation((S.Turn("No length given.", None),)),
        S.Conversation(
            (S.Turn("First?", 5), S.Turn("Second?", None), S.Turn("Third?", 50)),
            system="Be brief.\n\nBe kind.",
        ),
        S.Conversation((S.Turn("Only a question", None),)),
    ]


def test_sharegpt_as_a_json_array_and_as_json_lines_gives_the_same_conversations(tmp_path):
    array = _write(tmp_path, "s.json", json.dumps(SHAREGPT, indent=2, ensure_ascii=False))
    compact = _write(tmp_path, "c.json", json.dumps(SHAREGPT))  # one line, \u escapes
    lines = _write(tmp_path, "s.jsonl", _lines(*SHAREGPT))
    assert _read(array, "sharegpt") == _read(compact, "sharegpt") == _read(lines, "sharegpt") == SHAREGPT_WANT
    stats = S.read_dataset(array, "sharegpt", sample=2, seed=0, max_bytes=MB)[1]
    assert (stats.records_read, stats.records_kept, stats.bytes_read) == (3, 2, array.stat().st_size)
    in_array = [json.dumps(r, indent=2, ensure_ascii=False).replace("\n", "\n  ").encode() for r in SHAREGPT]
    assert stats.largest_line_bytes == len(in_array[1])  # the largest record as it sits in the array


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64])
def test_the_array_splitter_gives_the_same_records_whatever_the_chunk_boundaries(
    tmp_path, monkeypatch, chunk
):
    """Chunks of a few bytes split escapes, quotes, multi-byte characters and the byte-order mark."""
    path = _write(
        tmp_path, "s.json", b"\xef\xbb\xbf" + json.dumps(SHAREGPT, indent=1, ensure_ascii=False).encode()
    )
    monkeypatch.setattr(streams, "CHUNK_BYTES", chunk)
    assert _read(path, "sharegpt") == SHAREGPT_WANT


def test_a_byte_order_mark_crlf_blank_lines_and_escaped_surrogate_pairs_are_read(tmp_path):
    path = _write(
        tmp_path, "d.jsonl", b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n  \n{"prompt": "b \\ud83d\\ude00"}'
    )
    assert [c.turns[0].user for c in _read(path)] == ["a", "b \U0001f600"]


def _pretty(records: list[object]) -> bytes:
    return json.dumps(records, indent=2).encode()


# records 1-3 of the pretty-printed array start on lines 2, 10 and 18 (a fourth on 26), its ']' is on line 26
ARRAY = [{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]


@pytest.mark.parametrize(("fmt", "data", "kw", "message"), [
    ("jsonl", _lines({"prompt": "x" * 80}), {"max_bytes": 50}, r"is 95 bytes, above the workload's limit of 50 "
     r"\(max_bytes = 50\); raise max_bytes"),
    ("jsonl", _lines({"prompt": "a"}, {"prompt": "b"}, {"prompt": "x" * 200}), {"max_line_bytes": 100},
     r"line 3 is longer than 100 bytes \(max_line_bytes\)"),
    ("jsonl", b'{"prompt": "a"}\n{"prompt": "\xff"}\n', {}, r"line 2 is not UTF-8: byte 13 .*convert the file"),
    ("jsonl", _lines(*[{"prompt": "a"}] * 6) + "{prompt: 1}\n", {}, r"line 7 is not valid JSON: Expecting property "
     r"name .* at column 2; fix or remove"),
    ("jsonl", _lines({"prompt": "a"}, [1, 2]), {}, r"record 2 \(line 2\): is \[1, 2\], not a JSON object"),
    ("jsonl", _lines({"text": "a"}), {}, r"record 1 \(line 1\): has neither prompt nor messages;"),
    ("jsonl", _lines(SHAREGPT[0]), {}, r"has neither prompt nor messages \(it has conversations: read the file as "
     r"sharegpt\)"),
    ("jsonl", _lines({"prompt": "a", "messages": []}), {}, r"record 1 \(line 1\): has both prompt and messages"),
    ("jsonl", _lines({"prompt": ["a"]}), {}, r"record 1 \(line 1\): prompt is \[\"a\"\], not a string"),
    ("jsonl", _lines({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}]}), {},
     r"messages\[1\]\.content is 5, not a string"),
    ("jsonl", _lines({"messages": [{"role": "tool", "content": "a"}]}), {},
     r'messages\[0\]\.role = "tool" is not one of system, user, assistant'),
    ("jsonl", _lines({"messages": [{"role": "system", "content": "a"}]}), {}, r"has no user message"),
    ("jsonl", _lines({"messages": "hi"}), {}, r'messages is "hi", not a list'),
    ("jsonl", '{"prompt": "a\\ud800b"}\n', {}, r"record 1 \(line 1\): prompt holds a lone UTF-16 surrogate "
     r"\(\\ud800\) at character 1; fix or drop the record"),
    ("jsonl", '{"prompt": ' + "[" * 500 + "]" * 500 + "}\n", {}, r"prompt is \[\[\[.*, not a string"),
    ("jsonl", _lines({"prompt": "a"}, {"prompt": "a", "output_tokens": True}), {},
     r"record 2 \(line 2\): output_tokens = true is not a positive integer"),
    ("jsonl", _lines({"prompt": "a", "output_tokens": 0}), {}, r"output_tokens = 0 is not a positive integer"),
    ("jsonl", _lines({"prompt": "a", "output_tokens": -4}), {}, r"output_tokens = -4 is not a positive integer"),
    ("jsonl", _lines({"prompt": "a", "output_tokens": 5.0}), {}, r"output_tokens = 5.0 is not a positive integer"),
    ("jsonl", _lines({"prompt": "a", "output_tokens": "5"}), {}, r'output_tokens = "5" is not a positive integer'),
    ("jsonl", _lines({"prompt": "a", "output_tokens": 1_048_577}), {}, r"output_tokens = 1048577 is above 1048576"),
    ("jsonl", '{"prompt": "a", "output_tokens": NaN}\n', {}, r"line 1 is not valid JSON: NaN is not a number"),
    ("jsonl", '{"prompt": "a", "output_tokens": 1' + "0" * 5000 + "}\n", {}, r"line 1 is not valid JSON: Exceeds"),
    ("jsonl", '{"prompt": ' + "[" * 200_000 + "\n", {}, r"line 1 is not valid JSON: nested too deeply"),
    ("jsonl", b"", {}, r"is empty; name a dataset file"),
    ("jsonl", "\n  \n\n", {}, r"has no records"),
    ("jsonl", _pretty(ARRAY), {}, r"is a JSON array, not JSON lines; read it as sharegpt"),
    ("sharegpt", _lines(ARRAY[0], {"id": 1, "conversations": [{"from": "gpt", "value": "hi"}]}), {},
     r"record 2 \(line 2\): no human turn; drop the record"),
    ("sharegpt", _pretty([*ARRAY, {"conversations": []}]), {}, r"record 4 \(line 26\): no human turn"),
    ("sharegpt", _lines({"conversation": []}), {}, r"record 1 \(line 1\): lacks conversations"),
    ("sharegpt", _lines({"conversations": [{"from": "robot", "value": "a"}]}), {},
     r'conversations\[0\]\.from = "robot" is not one of human, user, system, gpt'),
    ("sharegpt", _lines({"conversations": [{"from": "human", "value": None}]}), {},
     r"conversations\[0\]\.value is null, not a string"),
    ("sharegpt", _pretty([*ARRAY, 7]), {}, r"record 4 \(line 26\): is 7, not a JSON object"),
    ("sharegpt", _pretty(ARRAY).replace(b'"q1"', b'"q1" x'), {}, r"record 2 \(line 10\) is not valid JSON: Expecting"
     r" ',' delimiter at line 14, column"),
    ("sharegpt", _pretty(ARRAY).replace(b"q2", b"q\xc3"), {}, r"record 3 \(line 18\) is not UTF-8: byte \d+ "
     r"\(line 22\)"),
    ("sharegpt", _pretty(ARRAY)[:-30], {}, r"ends inside record 3 \(line 18\): the file is cut short"),
    ("sharegpt", b"[\n", {}, r"ends before the array's '\]': the file is cut short"),
    ("sharegpt", _pretty(ARRAY)[:-2] + b",\n]", {}, r"line 26: a ',' before the array's '\]'"),
    ("sharegpt", _pretty(ARRAY) + b"\n\n[]", {}, r"line 28: '\[' after the array's closing '\]'"),
    ("sharegpt", _pretty(ARRAY).replace(b'"q1"', b'"q1"}'), {}, r"record 2 \(line 10\) is not valid JSON: a '}' "
     r"closes nothing"),
    ("sharegpt", _pretty([*ARRAY, {"conversations": [{"from": "human", "value": "x" * 300}]}]),
     {"max_line_bytes": 200}, r"record 4 \(line 26\) is longer than 200 bytes \(max_line_bytes\)"),
    ("sharegpt", " [ \n ] ", {}, r"has no records"),
])  # fmt: skip
def test_a_hostile_dataset_is_refused_naming_the_place_and_the_way_out(tmp_path, fmt, data, kw, message):
    path = _write(tmp_path, "evil.data", data)
    with pytest.raises(ConfigError, match=message) as err:
        S.read_dataset(path, fmt, **{"sample": 2, "seed": 0, "max_bytes": MB, **kw})
    assert str(err.value).startswith(f"dataset {path}: ")


def test_what_is_not_a_readable_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a regular file"):
        S.read_dataset(tmp_path, "jsonl", sample=1, seed=0, max_bytes=MB)
    with pytest.raises(ConfigError, match="cannot read it: No such file"):
        S.read_dataset(tmp_path / "nope.jsonl", "jsonl", sample=1, seed=0, max_bytes=MB)
    with pytest.raises(ConfigError, match="format 'csv' is not one of jsonl, sharegpt"):
        S.read_dataset(tmp_path / "x", "csv", sample=1, seed=0, max_bytes=MB)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="sample = 0; keep at least 1"):
        S.read_dataset(tmp_path / "x", "jsonl", sample=0, seed=0, max_bytes=MB)


# -- sampling -------------------------------------------------------------------------------------------------------
def _numbered(tmp_path: Path, n: int) -> Path:
    return _write(tmp_path, "n.jsonl", _lines(*({"prompt": f"p{i}"} for i in range(n))))


def _kept(path: Path, sample: int, seed: int) -> list[int]:
    return [int(c.turns[0].user[1:]) for c in _read(path, sample=sample, seed=seed)]


def test_the_sample_is_a_reservoir_deterministic_from_its_seed_and_in_file_order(tmp_path):
    path = _numbered(tmp_path, 100)
    first = _kept(path, 10, 1)
    assert len(first) == 10 and first == sorted(first) and len(set(first)) == 10
    assert _kept(path, 10, 1) == first
    assert _kept(path, 10, 2) != first
    assert first != list(range(10))  # records past the first ten are taken
    assert _kept(path, 1000, 1) == list(range(100))  # fewer records than the sample: all of them


def test_every_record_is_about_equally_likely_to_be_kept(tmp_path):
    """200 seeds, 10 of 100: each record is kept 20 times in expectation. Algorithm R gives the first and the last
    records the same chance; a reservoir that kept its first fill, or favoured late records, fails."""
    path = _numbered(tmp_path, 100)
    counts = [0] * 100
    for seed in range(200):
        for i in _kept(path, 10, seed):
            counts[i] += 1
    assert 140 <= sum(counts[:10]) <= 260 and 140 <= sum(counts[-10:]) <= 260
    assert max(counts) < 45


def test_a_bad_record_late_in_the_file_is_refused_though_the_sample_is_full_long_before(tmp_path):
    path = _numbered(tmp_path, 1000)
    text = path.read_text().splitlines()
    text[989] = '{"prompt": 5}'
    path.write_text("\n".join(text))
    with pytest.raises(ConfigError, match=r"record 990 \(line 990\): prompt is 5, not a string"):
        _read(path, sample=5, seed=3)


# -- a big file -----------------------------------------------------------------------------------------------------
def _big_sharegpt(path: Path, n: int) -> None:
    rng = random.Random(7)
    words = " ".join(rng.choices([*W.WORDS, 'say "hi"', "caf\u00e9", "a\\b", "x\ny", "[]{},"], k=40_000))

    def text(lo: int, hi: int) -> str:
        start = rng.randrange(len(words) - hi * 6)
        return words[start : start + rng.randint(lo, hi) * 5]

    records = []
    for i in range(n):
        conv = []
        for _ in range(rng.randint(1, 3)):
            conv += [{"from": "human", "value": text(10, 60)}, {"from": "gpt", "value": text(20, 150)}]
        records.append({"id": f"r{i}_0", "conversations": conv})
    with open(path, "w") as fh:
        json.dump(records, fh, indent=2, ensure_ascii=False)


def test_a_10000_conversation_sharegpt_array_is_read_in_memory_far_below_its_size(tmp_path):
    """The reader holds a 64 KiB chunk, the record being read and the 500 sampled ones, whatever the file's size.

    The bound: the sample keeps each record's user texts and its answers' token counts (an answer is counted when
    its record enters the sample, then dropped): about 500 x 0.4 KB here. With the chunk, the record being parsed
    and the reservoir's bookkeeping it measured 0.65 MB of a 14 MB file. 2 MB leaves room for a sample that kept
    whole records (~0.7 MB more); a reader that held the file, or every parsed record, would be many times over."""
    path = tmp_path / "big.json"
    _big_sharegpt(path, 10_000)
    size = path.stat().st_size
    t0 = time.perf_counter()
    convs, stats = S.read_dataset(path, "sharegpt", sample=500, seed=1, max_bytes=1 << 30)
    seconds = time.perf_counter() - t0
    tracemalloc.start()
    try:
        again, _ = S.read_dataset(path, "sharegpt", sample=500, seed=1, max_bytes=1 << 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"\n10,000 ShareGPT conversations, {size / MB:.1f} MB as a JSON array, sample 500: "
          f"{seconds:.2f} s, peak {peak / MB:.2f} MB (traced), {peak / size:.1%} of the file")  # fmt: skip
    assert again == convs and len(convs) == 500 and stats.records_read == 10_000 and stats.bytes_read == size
    assert peak < size / 4
    assert peak < 2 * MB


# -- traces ---------------------------------------------------------------------------------------------------------
def _row(ts: float, n_in: int = 600, n_out: int = 20, ids: list[int] | None = None) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out,
            "hash_ids": list(range(-(-n_in // 512))) if ids is None else ids}  # fmt: skip


def test_a_mooncake_trace_is_read_relative_to_its_first_row(tmp_path):
    path = _write(tmp_path, "t.jsonl", _lines(
        _row(1000, 512, 10, [4]), _row(1000, 513, 300, [4, 9]), {**_row(1500.5, 1, 1, [77]), "extra": "kept out"},
    ))  # fmt: skip
    assert S.read_trace(path, "mooncake", max_bytes=MB) == [
        S.TraceRow(0.0, 512, 10, (4,)), S.TraceRow(0.0, 513, 300, (4, 9)), S.TraceRow(500.5, 1, 1, (77,)),
    ]  # fmt: skip
    small = _write(tmp_path, "b.jsonl", _lines(_row(0, 40, 1, [1, 2, 3])))
    assert S.read_trace(small, "mooncake", max_bytes=MB, block_tokens=16)[0].hash_ids == (1, 2, 3)


def test_an_azure_trace_is_read_with_its_seven_fractional_digits_as_utc(tmp_path):
    path = _write(tmp_path, "a.csv", (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.0000000,396,109\n"
        "2023-11-16 18:15:47,1,1\n"
        "2023-11-17 00:00:00.0000001,2048,1\n"
    ))  # fmt: skip
    rows = S.read_trace(path, "azure", max_bytes=MB)
    assert [r.at_ms for r in rows] == [0.0, 319.41, 319.41, 20_653_319.4101]
    assert [(r.input_tokens, r.output_tokens, r.hash_ids) for r in rows][:2] == [
        (374, 44, ()),
        (396, 109, ()),
    ]


@pytest.mark.parametrize(("fmt", "data", "kw", "message"), [
    ("mooncake", _lines(*(_row(t) for t in range(0, 1101, 110)), _row(1030)), {},
     r"timestamps go backwards at line 12: 1030\.0 ms after 1100\.0 ms; sort the trace by time"),
    ("mooncake", _lines(_row(0), _row(1, 600, 20, [1, 2, 3])), {},
     r"line 2: 3 hash_ids for input_length 600: 2 blocks of 512 tokens; one hash id per 512-token block"),
    ("mooncake", _lines(_row(0, 600, 20, [1, -2])), {}, r"line 1: hash_ids\[1\] = -2 is not an integer from 0"),
    ("mooncake", _lines(_row(0, 600, 20, [1, 2**63])), {}, r"hash_ids\[1\] = 9223372036854775808 is not an int"),
    ("mooncake", _lines(_row(0, 600, 20, [1, True])), {}, r"hash_ids\[1\] = true is not an integer"),
    ("mooncake", _lines(_row(0, 0, 20, [])), {}, r"line 1: input_length = 0 is not a positive integer"),
    ("mooncake", _lines(_row(0, 10, 0)), {}, r"line 1: output_length = 0 is not a positive integer"),
    ("mooncake", _lines(_row(0, 2_000_000)), {}, r"input_length = 2000000 is above 1048576"),
    ("mooncake", _lines(_row(0), _row("10")), {}, r'line 2: timestamp = "10" is not a time in ms'),
    ("mooncake", _lines(_row(-1)), {}, r"timestamp = -1 is not a time in ms"),
    ("mooncake", _lines(_row(0), {"timestamp": 1}), {}, r"line 2: lacks input_length"),
    ("mooncake", '{"timestamp": Infinity}\n', {}, r"line 1 is not valid JSON: Infinity is not a number"),
    ("mooncake", _lines(_row(0)) + "{\n", {}, r"line 2 is not valid JSON"),
    ("mooncake", _lines(_row(0), _row(1), _row(2)), {"max_rows": 2}, r"has more than 2 rows \(max_rows\)"),
    ("mooncake", _lines(_row(0)) * 3, {"max_bytes": 100}, r"above the workload's limit of 100"),
    ("mooncake", b"\x00\xff\n", {}, r"line 1 is not UTF-8"),
    ("azure", "timestamp,context,generated\n1,2,3\n", {}, r"line 1: the header is \"timestamp,context,generated\","
     r" not TIMESTAMP,ContextTokens,GeneratedTokens"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n", {}, r"has no rows"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,1,1\n2023-11-16 18:15:46.6,1,1\n",
     {}, r"backwards at line 3: -80\.0 ms after 0\.0 ms"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46,1,1\n", {},
     r"line 2: TIMESTAMP \"2023-13-16 18:15:46\" is not a time: month must be in 1\.\.12"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n1700000000,1,1\n", {}, r"line 2: TIMESTAMP \"1700000000\""),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,0\n", {},
     r"line 2: GeneratedTokens = 0 is not a positive integer"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1e3,5\n", {},
     r'ContextTokens = "1e3" is not a positive integer'),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,2,3\n", {},
     r"line 2: has 4 fields, not 3"),
])  # fmt: skip
def test_a_hostile_trace_is_refused_naming_the_line(tmp_path, fmt, data, kw, message):
    path = _write(tmp_path, "evil.trace", data)
    with pytest.raises(ConfigError, match=message) as err:
        S.read_trace(path, fmt, **{"max_bytes": MB, **kw})
    assert str(err.value).startswith(f"trace {path}: ")


# -- the shipped samples --------------------------------------------------------------------------------------------
def test_the_committed_samples_are_what_the_module_makes_and_check_fails_when_they_drift(tmp_path):
    assert samples.main(["--check"]) == 0
    assert samples.main(["--dir", str(tmp_path)]) == 0
    assert samples.main(["--check", "--dir", str(tmp_path)]) == 0
    trace = tmp_path / samples.TRACE_SAMPLE
    trace.write_bytes(trace.read_bytes().replace(b'"timestamp": 0,', b'"timestamp": 1,', 1))
    assert samples.main(["--check", "--dir", str(tmp_path)]) == 1
    trace.unlink()
    assert samples.main(["--check", "--dir", str(tmp_path)]) == 1
    sizes = [(samples.DATA_DIR / name).stat().st_size for name in samples.render()]
    assert sum(sizes) < 600_000


def test_the_sample_dataset_reads_as_plausible_conversations():
    convs, stats = S.read_dataset(
        samples.DATA_DIR / samples.SHAREGPT_SAMPLE, "sharegpt", sample=1000, seed=0, max_bytes=MB
    )
    assert stats.records_read == len(convs) == 200
    assert {len(c.turns) for c in convs} == {1, 2, 3, 4, 5, 6}
    assert all(t.answer_tokens is not None for c in convs for t in c.turns)
    human = sorted(len(t.user.split()) for c in convs for t in c.turns)
    answers = sorted(t.answer_tokens or 0 for c in convs for t in c.turns)
    assert 30 <= human[len(human) // 2] <= 50 and human[-1] <= 400 and human[0] >= 3
    assert 100 <= answers[len(answers) // 2] <= 160 and answers[-1] <= 700  # 600 words and their marks
    assert max(sum(S.approx_tokens(t.user) + (t.answer_tokens or 0) for t in c.turns) for c in convs) <= 4096


def test_the_sample_trace_fits_the_context_shares_whole_blocks_and_has_bursts():
    rows = S.read_trace(samples.DATA_DIR / samples.TRACE_SAMPLE, "mooncake", max_bytes=MB)
    assert 550 <= len(rows) <= 650 and rows[0].at_ms == 0 and rows[-1].at_ms < 60_000
    assert all(r.input_tokens + r.output_tokens <= 4096 for r in rows)
    assert all(128 <= r.input_tokens <= 3000 and 16 <= r.output_tokens <= 300 for r in rows)
    holders = Counter(i for r in rows for i in r.hash_ids)
    shared = [r for r in rows if holders[r.hash_ids[0]] > 1]
    assert 0.2 <= len(shared) / len(rows) <= 0.4
    for r in (
        shared
    ):  # 1-4 leading blocks shared, each a whole block (the prompt goes on past them), the rest its own
        k = next(j for j, i in enumerate([*r.hash_ids, -1]) if holders[i] < 2)
        assert 1 <= k <= 4 and r.input_tokens > k * 512
        assert all(holders[i] == 1 for i in r.hash_ids[k:])
    per_second = [0] * 60
    for r in rows:
        per_second[int(r.at_ms // 1000)] += 1
    assert max(per_second) >= 3 * len(rows) / 60  # a burst
