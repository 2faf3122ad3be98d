"""A checkpoint's manifest: every file's size and SHA-256, written last and verified before a resume reads it.

A run checkpoint is written by many processes (every rank's shards, the driver's state and config); the
manifest records what the complete folder held, so that a file truncated, altered or deleted since (a disk
that filled up later, a copy that stopped half-way, a user's edit) is named before any worker starts rather
than failing inside one. ``sha256sum`` can check the same sums: ``manifest.json`` lists them per file.

Hashing reads every byte once (about 1 GB/s per thread with OpenSSL's SHA-256); files are hashed on a few
threads (hashlib releases the GIL on large buffers), so the cost is the filesystem's read bandwidth.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mcore_rl.io.errors import CheckpointIntegrityError

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
_SKIPPED = frozenset({MANIFEST_FILE, ".mcore_rl-output.json"})
"""Not listed: the manifest itself, and our ownership markers (rewritten when a folder is published)."""
_CHUNK_BYTES = 8 << 20


def _files(folder: str) -> list[str]:
    """Every regular file under ``folder`` as a relative path, sorted (links are not followed)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            path = os.path.join(root, name)
            if name not in _SKIPPED and not os.path.islink(path):
                found.append(os.path.relpath(path, folder))
    return sorted(found)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_all(folder: str, names: Iterable[str]) -> dict[str, str]:
    names = list(names)
    threads = max(1, min(8, len(names), os.cpu_count() or 1))
    with ThreadPoolExecutor(threads) as pool:
        sums = pool.map(lambda n: file_sha256(os.path.join(folder, n)), names)
        return dict(zip(names, sums, strict=True))


def write_manifest(folder: str) -> dict[str, Any]:
    """Record every file of ``folder`` (size and SHA-256) in ``folder/manifest.json``; returns the manifest."""
    names = _files(folder)
    sums = _hash_all(folder, names)
    entries = {n: {"bytes": os.path.getsize(os.path.join(folder, n)), "sha256": sums[n]} for n in names}
    manifest = {"format_version": FORMAT_VERSION, "files": entries}
    with open(os.path.join(folder, MANIFEST_FILE), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    return manifest


def has_manifest(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST_FILE))


def verify_manifest(folder: str, checksums: bool = True) -> None:
    """Every file the manifest lists is there with its size (and, with ``checksums``, its SHA-256); raises
    :class:`CheckpointIntegrityError` naming the first that is not. Files added since are not checked."""
    path = os.path.join(folder, MANIFEST_FILE)
    entries = _read_entries(path)
    for name, entry in entries.items():
        file = os.path.join(folder, name)
        if not os.path.isfile(file) or os.path.islink(file):
            raise CheckpointIntegrityError(f"{file}: missing (listed in {path})")
        size = os.path.getsize(file)
        if size != entry["bytes"]:
            how = "truncated" if size < entry["bytes"] else "longer than saved"
            raise CheckpointIntegrityError(f"{file}: {how} ({size} bytes, {entry['bytes']} when saved)")
    if not checksums:
        return
    sums = _hash_all(folder, entries)
    for name, entry in entries.items():
        if sums[name] != entry["sha256"]:
            raise CheckpointIntegrityError(
                f"{os.path.join(folder, name)}: altered since it was saved (its SHA-256 differs from {path})"
            )


def _read_entries(path: str) -> dict[str, dict[str, Any]]:
    """The manifest's file entries, every field checked (a damaged manifest is named as itself)."""
    try:
        with open(path) as f:
            manifest = json.load(f)
    except OSError as err:
        raise CheckpointIntegrityError(f"{path}: cannot read ({err.strerror})") from None
    except ValueError as err:
        raise CheckpointIntegrityError(f"{path}: not a readable manifest ({err})") from None
    if not isinstance(manifest, dict):
        manifest = {}
    entries = manifest.get("files")
    if manifest.get("format_version") != FORMAT_VERSION or not isinstance(entries, dict):
        raise CheckpointIntegrityError(f"{path}: not a manifest of format {FORMAT_VERSION}")
    for name, entry in entries.items():
        bad_name = os.path.isabs(name) or ".." in name.split(os.sep)
        well_formed = (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str)
        )
        if bad_name or not well_formed:
            raise CheckpointIntegrityError(f"{path}: bad entry {name!r}")
    return entries
