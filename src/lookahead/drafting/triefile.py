"""The trie file: a safe, versioned, checksummed container of the trie's columns.

Layout: an 8-byte magic, a little-endian u32 format version, a u64 payload length, the
SHA-256 of the payload, then the payload: a safetensors file (plain arrays plus a JSON
header, nothing that can run code) holding the node columns, with the trie's settings in
its metadata. The prefix lets a reader tell a wrong file, a newer version, a truncated
copy and a corrupted one apart, each with its own message, before parsing anything.
Writes go to a temporary file in the same folder, renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import asdict, dataclass, fields
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"LKATRIE\x00"
VERSION = 1
_PREFIX = struct.Struct("<8sIQ32s")
_COLUMNS = {"token": np.int32, "parent": np.int32, "count": np.int64, "weight": np.float64, "source": np.uint8}


@dataclass(frozen=True)
class TrieSettings:
    """What a trie file records besides its node columns (the file's metadata)."""

    ngram_length: int
    boundary_ids: list[int]
    max_nodes: int | None
    half_life: float | None
    age: float
    """Tokens learned since the decayed weights were last rescaled."""
    tokens_learned: int
    tokenizer_id: str | None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of a tokenizer's vocabulary (token text → id): equal ids mean equal tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def write_trie(path: str | PathLike[str], columns: dict[str, np.ndarray], settings: TrieSettings) -> None:
    """Write atomically: readers see the old file or the complete new one, never a part."""
    from safetensors.numpy import save

    arrays = {name: np.ascontiguousarray(columns[name], dtype=dtype) for name, dtype in _COLUMNS.items()}
    payload = save(arrays, metadata={"lookahead-trie": json.dumps(asdict(settings))})
    target = Path(path)
    fd, scratch = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(_PREFIX.pack(MAGIC, VERSION, len(payload), hashlib.sha256(payload).digest()))
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(scratch, target)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def read_trie(path: str | PathLike[str]) -> tuple[dict[str, np.ndarray], TrieSettings]:
    """Columns and settings of a trie file; ValueError, saying what is wrong, for any unsound file."""
    data = Path(path).read_bytes()
    if len(data) < _PREFIX.size or not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a lookahead trie file (bad magic)")
    _, version, length, digest = _PREFIX.unpack_from(data)
    if version != VERSION:
        raise ValueError(f"{path}: trie file version {version}; this version of lookahead reads version {VERSION}")
    payload = data[_PREFIX.size :]
    if len(payload) != length:
        raise ValueError(f"{path}: truncated or padded trie file ({len(payload)} payload bytes, expected {length})")
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError(f"{path}: corrupted trie file (checksum mismatch)")
    try:
        return _parse(payload)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: malformed trie file ({err})") from err


def _parse(payload: bytes) -> tuple[dict[str, np.ndarray], TrieSettings]:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    (header_length,) = struct.unpack_from("<Q", payload)
    header = json.loads(payload[8 : 8 + header_length])
    settings = json.loads(header["__metadata__"]["lookahead-trie"])
    if not isinstance(settings, dict) or set(settings) != {f.name for f in fields(TrieSettings)}:
        raise ValueError("unexpected settings")
    try:
        arrays = load(payload)
    except SafetensorError as err:
        raise ValueError(str(err)) from err
    if set(arrays) != set(_COLUMNS) or any(arrays[n].dtype != d or arrays[n].ndim != 1 for n, d in _COLUMNS.items()):
        raise ValueError("unexpected columns")
    return arrays, TrieSettings(**settings)
