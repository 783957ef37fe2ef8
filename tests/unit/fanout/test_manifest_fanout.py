import subprocess

import pytest

from deploybench import manifest
from deploybench.fanout import checklist, manifest_script, parse_manifest_listing


def test_seeded_model_verifies_and_corruption_is_named(tmp_path):
    m = manifest.seed_model(tmp_path / "m", total_mb=1, shards=2)
    assert manifest.verify(tmp_path / "m").digest == m.digest
    biggest = max(m.files, key=lambda f: f.size)
    shard = tmp_path / "m" / biggest.path
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(manifest.ManifestMismatch, match=biggest.path):
        manifest.verify(tmp_path / "m")


def test_seed_is_deterministic(tmp_path):
    a = manifest.seed_model(tmp_path / "a", total_mb=1, shards=2, seed=7)
    b = manifest.seed_model(tmp_path / "b", total_mb=1, shards=2, seed=7)
    c = manifest.seed_model(tmp_path / "c", total_mb=1, shards=2, seed=8)
    assert a.digest == b.digest != c.digest


def test_remote_manifest_script_matches_python(tmp_path):
    """The shell listing the fan-out runs on a node gives the same manifest as the Python one."""
    d = tmp_path / "model dir"
    m = manifest.seed_model(d, total_mb=1, shards=3)
    (d / "sub").mkdir()
    (d / "sub" / "odd name.txt").write_text("x")
    out = subprocess.run(["sh", "-c", manifest_script(str(d))], capture_output=True, text=True, check=True).stdout
    remote = parse_manifest_listing(out)
    assert remote.digest == manifest.build(d).digest
    assert remote.digest != m.digest  # the extra file counts


def test_checklist_feeds_sha256sum(tmp_path):
    d = tmp_path / "m"
    m = manifest.seed_model(d, total_mb=1, shards=2)
    ok = subprocess.run(["sha256sum", "-c", "--quiet", "--strict", "-"], input=checklist(m), cwd=d)
    assert ok.returncode == 0
    (d / m.files[0].path).write_text("changed")
    bad = subprocess.run(["sha256sum", "-c", "--quiet", "--strict", "-"], input=checklist(m), cwd=d,
                         capture_output=True)
    assert bad.returncode != 0
