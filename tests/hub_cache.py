"""Build a Hugging Face hub cache on disk, laid out exactly as huggingface_hub writes it.

No machine here can reach the hub, so the tests exercise the real download path
(``hf_hub_download`` in offline mode) against a cache they populate themselves:
``<cache>/models--owner--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
refs/<revision>}``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_hub_cache(cache_dir, repo_id: str, files: dict, revision: str = "main", commit: str | None = None) -> Path:
    """Put ``files`` ({filename: bytes}) into the cache as ``repo_id@revision``; return the snapshot directory."""
    owner, name = repo_id.split("/")
    repo_dir = Path(cache_dir) / f"models--{owner}--{name}"
    commit = commit or hashlib.sha1(repr(sorted(files)).encode() + revision.encode()).hexdigest()
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / revision).write_text(commit)
    for filename, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / filename
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, link.parent), link)
    return snapshot


def hub_layout_files(directory) -> dict:
    """{filename: bytes} of a directory in hub layout (config.json + model.safetensors)."""
    return {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}
