"""The model manifest: every file of a model directory with its size and sha256.

The manifest is written into the model directory as ``MANIFEST_NAME``; its own hash
(over the sorted file list) identifies the model artifact. Fan-out verifies copies
against it, and the simulated engine refuses to start on a directory that does not
match it, as a real engine fails on a broken checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from deploybench.errors import DeploybenchError

MANIFEST_NAME = ".deploybench-manifest.json"
_CHUNK = 1 << 20


class ManifestMismatch(DeploybenchError):
    """A model directory does not match its manifest (missing, resized or corrupt file)."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a model folder. The path is checked on construction (relative, no ``..``, no control
    character: ``relay.path_problem``), so a manifest from a node can never name a file outside the folder."""

    path: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        # the rule is the relay's (a stdlib-only program copied to nodes); imported here, not at the top,
        # because the fanout package itself imports this module
        from deploybench.fanout.relay import entry_problem

        why = entry_problem({"path": self.path, "size": self.size, "sha256": self.sha256})
        if why:
            raise ManifestMismatch(f"manifest entry {why}")


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        """The artifact id: sha256 over the canonical file list."""
        blob = json.dumps([asdict(f) for f in self.files], sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def to_json(self) -> str:
        return json.dumps({"digest": self.digest, "files": [asdict(f) for f in self.files]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        m = cls(tuple(FileEntry(**f) for f in data["files"]))
        if data.get("digest") not in (None, m.digest):
            raise ManifestMismatch(f"manifest digest {data['digest']} does not match its file list ({m.digest})")
        return m

    @classmethod
    def read(cls, model_dir: str | Path) -> Manifest:
        p = Path(model_dir) / MANIFEST_NAME
        try:
            return cls.from_json(p.read_text())
        except FileNotFoundError as exc:
            raise ManifestMismatch(f"{p}: no manifest in the model directory") from exc

    def write(self, model_dir: str | Path) -> Path:
        p = Path(model_dir) / MANIFEST_NAME
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(p)
        return p


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def build(model_dir: str | Path) -> Manifest:
    """Hash every regular file under ``model_dir`` (the manifest itself excluded)."""
    root = Path(model_dir)
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel == MANIFEST_NAME or rel.endswith(".tmp"):
                continue
            if full.is_symlink() or not full.is_file():
                raise ManifestMismatch(f"{full}: not a regular file (a symbolic link is never followed into a "
                                       "manifest); replace it by the file itself or remove it")
            entries.append(FileEntry(rel, full.stat().st_size, sha256_file(full)))
    return Manifest(tuple(sorted(entries, key=lambda e: e.path)))


def verify(model_dir: str | Path, manifest: Manifest | None = None) -> Manifest:
    """Check every file of ``model_dir`` against ``manifest`` (default: the one inside the directory).

    Raises ManifestMismatch naming the first missing, resized or corrupt file.
    """
    root = Path(model_dir)
    m = manifest or Manifest.read(root)
    for f in m.files:
        p = root / f.path
        if not p.is_file():
            raise ManifestMismatch(f"{p}: missing (the manifest lists {f.size} bytes, sha256 {f.sha256[:16]}...)")
        size = p.stat().st_size
        if size != f.size:
            raise ManifestMismatch(f"{p}: {size} bytes, the manifest says {f.size}")
        digest = sha256_file(p)
        if digest != f.sha256:
            raise ManifestMismatch(f"{p}: sha256 {digest[:16]}... does not match the manifest's {f.sha256[:16]}...")
    return m


def seed_model(model_dir: str | Path, total_mb: float = 64, shards: int = 4, seed: int = 0) -> Manifest:
    """Write a synthetic model (config, tokenizer, weight shards of pseudo-random bytes) and its manifest.

    Deterministic for a given seed, so two labs seeded alike hold the same artifact.
    """
    import random

    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    (root / "config.json").write_text(
        json.dumps({"architectures": ["SimForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32, "seed": seed})
    )
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab_size": 32000}}))
    shard_bytes = int(total_mb * 1024 * 1024 / shards)
    for i in range(shards):
        name = root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with open(name, "wb") as f:
            left = shard_bytes
            while left > 0:
                n = min(left, _CHUNK)
                f.write(rng.randbytes(n))
                left -= n
    m = build(root)
    m.write(root)
    return m
