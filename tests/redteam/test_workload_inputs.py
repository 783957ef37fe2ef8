"""Red team, issue 27: a workload's files are read as hostile input, and a bad one stops the run at validate.

The operator's workload folder ($DEPLOYBENCH_WORKLOADS) may hold a dataset or trace somebody else produced; a form
user picks a workload by name only. Each test triggers the library's own validate stage (exactly what Airflow hands
the validate task) on a real inventory file and asserts the run is refused, naming the value and the way out, with
no run.json written: nothing reached a node.
"""

from __future__ import annotations

import json
import os

import pytest

from deploybench import paths, pipeline, workloads
from tests.support.refusals import refused as _refused

pytestmark = pytest.mark.time_limit(60)


@pytest.fixture
def rack(inventory, tmp_path, monkeypatch):
    """The inventory ``rack`` (conftest.py) and an operator's workload folder; returns the folder."""
    folder = tmp_path / "workloads"
    folder.mkdir()
    monkeypatch.setenv(workloads.WORKLOAD_ENV, str(folder))
    return folder


def _dataset(folder, name: str, data: bytes, fmt: str = "jsonl", extra: str = "") -> None:
    (folder / f"{name}.data").write_bytes(data)
    (folder / f"{name}.toml").write_text(
        f'name = "{name}"\n[source]\nkind = "dataset"\npath = "{name}.data"\nformat = "{fmt}"\n{extra}')


def test_a_good_workload_validates_and_its_file_digest_is_recorded(rack):
    _dataset(rack, "good", b'{"prompt": "hello there", "output_tokens": 8}\n{"prompt": "and you"}\n')
    pipeline.validate("deploybench_run__wl_ok", {"inventory": "rack", "workload": "good"})
    run = json.loads((paths.run_dir("deploybench_run__wl_ok") / "run.json").read_text())
    assert run["workload"]["name"] == "good" and len(run["workload"]["digest"]) == 64
    assert run["config"]["load"]["workload"] == "good"


@pytest.mark.parametrize(("name", "words"), [
    ("nope", ["unknown workload 'nope'", "choose one of"]),
    ("../../etc/passwd", ["workload", "should match pattern"]),
])
def test_a_form_user_picks_a_workload_by_name_only(rack, name, words):
    _refused(f"deploybench_run__wl_{abs(hash(name))}", {"workload": name}, *words)


def test_a_dataset_that_is_not_jsonl_is_refused_naming_the_line(rack):
    _dataset(rack, "broken", b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": \n')
    _refused("deploybench_run__wl_b1", {"workload": "broken"}, "line 3", "not valid JSON")


def test_a_sharegpt_record_without_a_human_turn_is_refused(rack):
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    bad = {"id": "b", "conversations": [{"from": "gpt", "value": "nobody asked"}]}
    _dataset(rack, "sgpt", (json.dumps(good) + "\n" + json.dumps(bad) + "\n").encode(), fmt="sharegpt")
    _refused("deploybench_run__wl_b2", {"workload": "sgpt"}, "line 2", "no human turn")


def test_a_trace_whose_times_go_backwards_is_refused(rack):
    rows = [{"timestamp": t, "input_length": 20, "output_length": 4, "hash_ids": [i]}
            for i, t in enumerate([0, 100, 50])]
    (rack / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (rack / "back.toml").write_text(
        'name = "back"\n[source]\nkind = "trace"\npath = "t.jsonl"\nformat = "mooncake"\nblock_tokens = 32\n')
    _refused("deploybench_run__wl_b3", {"workload": "back"}, "backwards", "line 3")


def test_requests_longer_than_the_engines_context_are_refused(rack):
    rows = [{"timestamp": 0, "input_length": 3000, "output_length": 2000, "hash_ids": list(range(94))}]
    (rack / "long.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (rack / "long.toml").write_text(
        'name = "long"\n[source]\nkind = "trace"\npath = "long.jsonl"\nformat = "mooncake"\nblock_tokens = 32\n')
    _refused("deploybench_run__wl_b4", {"workload": "long"}, "trace row 1", "max_model_len=4096")
    _refused("deploybench_run__wl_b5", {"workload": "chat-lognormal", "max_model_len": 2048},
             "longest request (3072 tokens", "max_model_len=2048")


def test_a_workload_file_with_an_unknown_key_is_refused(rack):
    (rack / "typo.toml").write_text('name = "typo"\n[arrival]\nproces = "poisson"\n')
    _refused("deploybench_run__wl_b6", {"workload": "typo"}, "typo.toml", "arrival.proces: unknown key")


def test_a_dataset_bigger_than_its_stated_limit_is_refused(rack):
    _dataset(rack, "big", b'{"prompt": "hello"}\n' * 100, extra="max_bytes = 1000\n")
    _refused("deploybench_run__wl_b7", {"workload": "big"}, "2000 bytes", "1000")


def test_a_data_path_out_of_the_workload_folder_is_refused(rack, tmp_path):
    (tmp_path / "secret.jsonl").write_text('{"prompt": "the operator\'s secret"}\n')
    (rack / "dots.toml").write_text(
        'name = "dots"\n[source]\nkind = "dataset"\npath = "../secret.jsonl"\nformat = "jsonl"\n')
    _refused("deploybench_run__wl_b8", {"workload": "dots"}, "path = '../secret.jsonl'", "no ..")
    (rack / "dots.toml").unlink()  # a bad file in the folder stops every run until it is fixed
    os.symlink(tmp_path / "secret.jsonl", rack / "link.jsonl")
    (rack / "link.toml").write_text(
        'name = "link"\n[source]\nkind = "dataset"\npath = "link.jsonl"\nformat = "jsonl"\n')
    _refused("deploybench_run__wl_b9", {"workload": "link"}, "leads out of its folder")


def test_a_trace_on_its_own_clock_cannot_be_probed(rack):
    _refused("deploybench_run__wl_b10", {"workload": "trace-sample", "load_phases": ["probe", "sustained"]},
             "follow_rate = true", "own clock")
