"""The trie file: a safe, versioned, checksummed container of the trie's columns.

Layout: an 8-byte magic, a little-endian u32 format version, a u64 payload length, the
SHA-256 of the payload, then the payload: a safetensors file (plain arrays plus a JSON
header, nothing that can run code) holding the node columns, with the trie's settings in
its metadata. The prefix lets a reader tell a wrong file, a newer version, a truncated
copy and a corrupted one apart, each with its own message, before parsing anything.
Writes go to a temporary file in the same folder, renamed into place when complete.

A file is data from anywhere, so reading it is bounded whatever it holds: only a regular file
is opened, its declared length is checked against its size and MAX_PAYLOAD_BYTES before the
payload is read, and every structure is checked before it is used. Every problem is a
ValueError that names the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import struct
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..config import check_recycled

MAGIC = b"LKATRIE\x00"
VERSION = 3
"""Version 2 adds the recycled table (a 2-d column), version 3 what the model's output last had after each token (a
column of pairs); a file is written at the lowest version that holds what it has, so version 1 files (neither) are
read by every version."""
READABLE_VERSIONS = (1, 2, 3)
_PREFIX = struct.Struct("<8sIQ32s")
_COLUMNS = {"token": np.int32, "parent": np.int32, "count": np.int64, "weight": np.float64, "source": np.uint8}
RECYCLED_COLUMN = "recycled"
"""The recycled table (tokens x k, int32), present when the trie keeps one (drafting/recycled.py)."""
MODEL_NEXT_COLUMN = "model_next"
"""(token, the token the model's output last had after it) pairs, int32 (TokenTrie), present when any is known."""
MAX_PAYLOAD_BYTES = 1 << 30
"""Largest payload read: 40 million nodes of 25 bytes, forty times the default budget (and about
8 GB once loaded). A larger file is refused from its size, before any of it is read."""
_MAX_HEADER_BYTES = 1 << 20
"""Largest safetensors header read: a trie's is a few hundred bytes (five columns and its settings)."""
STALE_SCRATCH_S = 600.0
"""A temporary file untouched this long, whose writer is not running, was left by a killed save."""

log = logging.getLogger("lookahead.trie")


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
    recycled: int = 0
    """Next tokens kept per token in the recycled table (0: none; files of version 1 have none)."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of a tokenizer's vocabulary (token text → id): equal ids mean equal tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def write_trie(path: str | PathLike[str], columns: dict[str, np.ndarray], settings: TrieSettings) -> None:
    """Write atomically: readers see the old file or the complete new one, never a part.

    The temporary file's name holds the writer's pid, so a later save can tell what a killed
    one left behind (see `remove_stale_scratch`, which runs first).
    """
    from safetensors.numpy import save

    arrays = {name: np.ascontiguousarray(columns[name], dtype=dtype) for name, dtype in _COLUMNS.items()}
    record = asdict(settings)
    version = 1
    for name, since in ((RECYCLED_COLUMN, 2), (MODEL_NEXT_COLUMN, 3)):
        if name in columns:
            arrays[name] = np.ascontiguousarray(columns[name], dtype=np.int32)
            version = since
    if RECYCLED_COLUMN not in columns:  # what version 1 holds: readers of version 1 read it
        del record["recycled"]
    payload = save(arrays, metadata={"lookahead-trie": json.dumps(record)})
    target = Path(path)
    remove_stale_scratch(target)
    fd, scratch = tempfile.mkstemp(prefix=f"{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(_PREFIX.pack(MAGIC, version, len(payload), hashlib.sha256(payload).digest()))
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(scratch, target)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def remove_stale_scratch(path: str | PathLike[str]) -> list[Path]:
    """Delete the temporary files killed saves of `path` left in its folder; returns them.

    Only files named as `write_trie` names them, `NAME.PID.RANDOM.tmp`, that have not changed
    for STALE_SCRATCH_S and whose pid is not a running process. Both must hold: a pid alone
    would not protect the file of a save running in another pid namespace sharing the folder.
    """
    target = Path(path)
    pattern = re.compile(re.escape(target.name) + r"\.(\d+)\.[a-z0-9_]+\.tmp")
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return []
    removed = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or not _abandoned(entry, match.group(1)):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:  # another process swept it first
            continue
        removed.append(Path(entry.path))
    if removed:
        log.warning("removed %d temporary file(s) left by an interrupted save of %s", len(removed), target)
    return removed


def _abandoned(entry: os.DirEntry, pid: str) -> bool:
    """True when `entry` is a regular file unchanged for STALE_SCRATCH_S whose writer is not running."""
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode) or time.time() - info.st_mtime < STALE_SCRATCH_S:
        return False
    return not _running(int(pid))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # it exists, and belongs to someone else
        return True
    return True


def read_trie(path: str | PathLike[str]) -> tuple[dict[str, np.ndarray], TrieSettings]:
    """Columns and settings of a trie file; ValueError, naming the file and what is wrong, for any unsound one.

    Checked here: the container, the columns' names, types and shapes, and that the settings
    record has its fields; the settings' values are checked where they are used (TokenTrie).
    """
    try:
        with _open_regular_file(path) as file:
            version, payload = _read_payload(file, path)
    except OSError as err:
        raise ValueError(f"{path}: cannot read the trie file ({err.strerror or err})") from err
    try:
        return _parse(payload, version)
    except ValueError as err:
        raise ValueError(f"{path}: malformed trie file ({err})") from err


def _open_regular_file(path: str | PathLike[str]) -> BinaryIO:
    """`path` opened for reading; ValueError if it is not a regular file (after following links).

    A directory, a FIFO or a device is refused from its stat, before it is opened (opening a
    FIFO blocks until a writer comes, and a device may never end); the open is non-blocking
    and the opened file checked again, in case the path changed in between.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path}: not a regular file (a directory, a pipe or a device), so not a trie file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    file = os.fdopen(fd, "rb")  # buffered: read(n) returns n bytes unless the file ends
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        file.close()
        raise ValueError(f"{path}: not a regular file (it changed while being opened)")
    return file


def _read_payload(file: BinaryIO, path: str | PathLike[str]) -> tuple[int, bytes]:
    """The file's version and the payload after the prefix, read only once its declared length matches the file's
    size."""
    prefix = file.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size or not prefix.startswith(MAGIC):
        raise ValueError(f"{path}: not a lookahead trie file (bad magic)")
    _, version, length, digest = _PREFIX.unpack(prefix)
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{path}: trie file version {version}; this lookahead reads versions 1 to {VERSION}")
    size = os.fstat(file.fileno()).st_size - _PREFIX.size
    if size != length:
        raise ValueError(f"{path}: truncated or padded trie file ({size} payload bytes, expected {length})")
    if length > MAX_PAYLOAD_BYTES:
        raise ValueError(f"{path}: trie file payload of {length} bytes is over the limit of {MAX_PAYLOAD_BYTES}")
    payload = file.read(length)
    if len(payload) != length:
        raise ValueError(f"{path}: truncated trie file (it shrank while being read)")
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError(f"{path}: corrupted trie file (checksum mismatch)")
    return version, payload


def _parse(payload: bytes, version: int) -> tuple[dict[str, np.ndarray], TrieSettings]:
    """Settings and columns of a payload whose checksum matched: sound or not, it is checked, not trusted."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    settings = _settings(_json(_metadata(_header(payload)), "the settings"))
    try:
        arrays = load(payload)
    except SafetensorError as err:
        raise ValueError(str(err)) from err
    expected = set(_COLUMNS) | ({RECYCLED_COLUMN} if settings.recycled else set())
    optional = {MODEL_NEXT_COLUMN} if version >= 3 else set()
    if not expected <= set(arrays) <= expected | optional:
        also = f" and maybe {MODEL_NEXT_COLUMN}" if optional else ""
        raise ValueError(f"columns {sorted(arrays)}, expected {sorted(expected)}{also}")
    for name, dtype in _COLUMNS.items():
        column = arrays[name]
        if column.dtype != dtype or column.ndim != 1:
            raise ValueError(f"column {name} is {column.ndim}-d {column.dtype}, expected 1-d {np.dtype(dtype)}")
    return arrays, settings


def _header(payload: bytes) -> dict[str, Any]:
    """The safetensors header, its length checked against the payload before it is sliced."""
    if len(payload) < 8:
        raise ValueError(f"a {len(payload)}-byte payload has no room for a safetensors header")
    (length,) = struct.unpack_from("<Q", payload)
    if length > min(len(payload) - 8, _MAX_HEADER_BYTES):
        raise ValueError(f"safetensors header of {length} bytes in a {len(payload)}-byte payload")
    header = _json(payload[8 : 8 + length], "the safetensors header")
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    return header


def _metadata(header: dict[str, Any]) -> str:
    """The settings' JSON text, which `write_trie` keeps in the safetensors metadata."""
    metadata = header.get("__metadata__")
    settings = metadata.get("lookahead-trie") if isinstance(metadata, dict) else None
    if not isinstance(settings, str):
        raise ValueError("no lookahead-trie settings in the safetensors metadata")
    return settings


def _json(text: str | bytes, what: str) -> Any:
    """Parsed JSON; ValueError, never RecursionError, for deep nesting."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what}: JSON nested too deeply") from None
    except ValueError as err:
        raise ValueError(f"{what}: not JSON ({err})") from None


def _settings(record: Any) -> TrieSettings:
    """The settings record, if it has TrieSettings' fields (`recycled` may be missing: version 1), and no others.

    Their values are TokenTrie's to check, but for `recycled`, which says which columns to expect.
    """
    names = {f.name for f in fields(TrieSettings)}
    if not isinstance(record, dict) or not names - {"recycled"} <= set(record) <= names:
        raise ValueError(f"the settings are not a record of {', '.join(sorted(names))} (recycled may be missing)")
    settings = TrieSettings(**record)
    check_recycled(settings.recycled, "recycled")
    return settings
