"""Checksums of exported weight folders (no torch import: the syncer uses this too)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
CHECKSUM_FILE = "model.safetensors.sha256"


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file (read in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def verify_folder(path: str | os.PathLike, sha256: str | None = None) -> str:
    """Recompute the sha256 of ``path/model.safetensors``; compare to ``sha256`` and the checksum file.

    Returns the hex digest. Raises ``FileNotFoundError`` if the weights are missing and
    ``ValueError`` on a mismatch (a torn or tampered folder).
    """
    path = Path(path)
    digest = sha256_file(path / WEIGHTS_FILE)
    if sha256 is not None and digest != sha256:
        raise ValueError(f"{path}: sha256 {digest} != published {sha256}")
    side = path / CHECKSUM_FILE
    if side.exists() and side.read_text().split()[0] != digest:
        raise ValueError(f"{path}: sha256 {digest} != {CHECKSUM_FILE}")
    return digest
