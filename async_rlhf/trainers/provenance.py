"""Which initial policy a run trained from: the `initial_policy` section of `run_summary.json`.

Two records of one setting and seed are comparable only if they started from the same weights. A cached task's SFT
policy is built once per machine (`tasks/build_*.py`) and is rebuilt when its cache is gone; the same code on the same
machine builds the same bytes, but a rebuild by other code, or with another number of threads, can be another
policy, and nothing in a record said so (it happened to the sorting
study: `evals/results/sorting_staleness/NOTES.md`, "Which SFT policy"). So every run records:

* a local directory (every built-in task's policy, a user's checkpoint): its absolute path and a SHA-256 over its
  weight files (`*.safetensors`, else `*.bin`; names and contents, in name order), computed on rank 0 before
  training; above `HASH_LIMIT_BYTES` of weights only their names and sizes are hashed (`content: false`), which
  tells two builds apart only by size;
* a hub id: the id and the snapshot commit transformers resolved (`config._commit_hash`), when it is known;
* an in-memory model: its `name_or_path` and no fingerprint.

`evals/compare.py` reads it and says when a cell pools runs from more than one initial policy.
"""

from __future__ import annotations

import glob
import hashlib
import os

HASH_LIMIT_BYTES = 1 << 30  # content-hash at most 1 GiB of weights (about a second); above, names and sizes only
CHUNK_BYTES = 1 << 22


def weight_files(directory: str) -> list[str]:
    """The directory's weight files in name order: its safetensors files, else its PyTorch .bin files."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    return files or sorted(glob.glob(os.path.join(directory, "*.bin")))


def fingerprint(directory: str, limit: int = HASH_LIMIT_BYTES) -> dict:
    """{"sha256", "bytes", "files", "content"} of the directory's weights (see the module docstring)."""
    files = weight_files(directory)
    total = sum(os.path.getsize(f) for f in files)
    content = total <= limit
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{os.path.basename(path)}\0{os.path.getsize(path)}\0".encode())
        if content:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    digest.update(chunk)
    return {"sha256": digest.hexdigest(), "bytes": total, "files": len(files), "content": content}


def initial_policy_record(source_path: str | None, model) -> dict:
    """The `initial_policy` section: `source_path` is what the trainer was given as `model` when it was a string
    (None for an in-memory model), `model` the loaded policy."""
    config = getattr(model, "config", None)
    name = source_path or getattr(config, "name_or_path", None) or type(model).__name__
    if source_path is not None and os.path.isdir(source_path):
        return {"path": os.path.abspath(source_path), **fingerprint(source_path)}
    record = {"path": name}
    commit = getattr(config, "_commit_hash", None)
    if source_path is not None and commit:
        record["commit"] = commit
    return record
