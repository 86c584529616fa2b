"""Hostile trie files. Each is refused with a ValueError that names the file and the problem, in
bounded time and memory, or it loads into a trie that still drafts, learns, saves and loads back."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_trie_store import _check_structure, _ngrams

from lookahead.drafting.trie import TokenTrie
from lookahead.drafting.triefile import _PREFIX, MAGIC, MAX_PAYLOAD_BYTES, VERSION, read_trie

VOCAB = 1000
"""The vocabulary a trie is bound to in these tests; sample tries use ids far below it."""


# ---- the generator ------------------------------------------------------------------------


def sample_trie() -> TokenTrie:
    """A small sound trie: output and corpus n-grams, a boundary id, decayed weights, evictions."""
    trie = TokenTrie(ngram_length=4, boundary_ids=[0], max_nodes=60, half_life=40.0)
    rng = np.random.default_rng(7)
    for i in range(12):
        trie.observe(i, rng.integers(1, 30, 12).tolist())
        trie.finish(i)
    trie.insert([5, 6, 7, 8, 0, 5, 6, 9])
    return trie


def _saved_sample() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        sample_trie().save(Path(tmp) / "sample")
        return (Path(tmp) / "sample").read_bytes()


GOOD = _saved_sample()
"""The bytes of a sound trie file, which every hostile file is made from."""


def sample_parts() -> tuple[dict[str, np.ndarray], dict]:
    """The columns and the settings record in GOOD."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sample").write_bytes(GOOD)
        columns, record = read_trie(Path(tmp) / "sample")
    return {name: column.copy() for name, column in columns.items()}, asdict(record)


def container(payload: bytes, length: int | None = None) -> bytes:
    """A trie file around `payload`, with its checksum right (so the parser is reached)."""
    size = len(payload) if length is None else length
    return _PREFIX.pack(MAGIC, VERSION, size, hashlib.sha256(payload).digest()) + payload


def trie_payload(columns: dict[str, np.ndarray], record: object) -> bytes:
    """A safetensors payload as write_trie makes one, from any columns and any settings record."""
    from safetensors.numpy import save

    arrays = {name: np.ascontiguousarray(column) for name, column in columns.items()}
    return save(arrays, metadata={"lookahead-trie": json.dumps(record)})


def raw_payload(header: object, data: bytes = b"") -> bytes:
    """A safetensors payload with a hand-written header (JSON-encoded unless given as bytes)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


Edit = Callable[[dict[str, np.ndarray], dict], object]
"""Changes sample columns and settings in place; may return a replacement settings record."""


def _set(column: str, row: int, value: object) -> Edit:
    def edit(columns: dict[str, np.ndarray], record: dict) -> None:
        columns[column][row] = value

    return edit


def _setting(name: str, value: object) -> Edit:
    def edit(columns: dict[str, np.ndarray], record: dict) -> None:
        record[name] = value

    return edit


def _cast(column: str, dtype: object, shape: tuple[int, ...] | None = None) -> Edit:
    def edit(columns: dict[str, np.ndarray], record: dict) -> None:
        columns[column] = columns[column].astype(dtype).reshape(shape or (-1,))

    return edit


def _chain(columns: dict[str, np.ndarray], record: dict) -> None:
    """Five nodes each below the last: a 5-gram in a trie of 4-grams."""
    for name, value in {"token": 1, "count": 1, "weight": 1.0, "source": 1}.items():
        columns[name] = np.full(5, value, dtype=columns[name].dtype)
    columns["parent"] = np.arange(5, dtype=np.int32)


def _above_parent(columns: dict[str, np.ndarray], record: dict) -> None:
    """A node counted more often than its parent: a ratio above 1."""
    row = int(np.flatnonzero(columns["parent"] > 0)[0])
    columns["count"][row] = columns["count"][columns["parent"][row] - 1] + 1


def _twin(columns: dict[str, np.ndarray], record: dict) -> None:
    """Two children of the root with the same token: one n-gram stored twice."""
    roots = np.flatnonzero(columns["parent"] == 0)
    columns["token"][roots[1]] = columns["token"][roots[0]]


def _drop(column: str) -> Edit:
    def edit(columns: dict[str, np.ndarray], record: dict) -> None:
        del columns[column]

    return edit


def _next_twice(columns: dict[str, np.ndarray], record: dict) -> None:
    """What the model last chose after one token, stored twice."""
    columns["model_next"][1, 0] = columns["model_next"][0, 0]


def _extra(columns: dict[str, np.ndarray], record: dict) -> None:
    columns["pickle"] = np.zeros(3, dtype=np.uint8)


def _shorter(columns: dict[str, np.ndarray], record: dict) -> None:
    columns["count"] = columns["count"][:-1]


def _replace(record: object) -> Edit:
    return lambda columns, _: record


def _missing(name: str) -> Edit:
    def edit(columns: dict[str, np.ndarray], record: dict) -> None:
        del record[name]

    return edit


BAD_SETTINGS = {
    "ngram_length": [0, 1, 257, 1_000_000, 2.5, 4.0, True, "4", None],
    "half_life": [0, -1, float("nan"), float("inf"), True, "40"],
    "max_nodes": [0, -5, 10.5, 100.0, True, "100"],
    "boundary_ids": ["abc", 5, [1.5], [True], [-1], [1 << 24], [[0]], None],
    "age": [-1, float("nan"), float("inf"), True, "0", None],
    "tokens_learned": [-1, 1.5, True, "3", None],
    "tokenizer_id": [5, ["x"], True, {"id": "x"}],
}
"""Settings a save never writes, each refused with its name in the message."""

ODD_BUT_HARMLESS = {
    "tiny half-life": {"half_life": 1e-300, "age": 7.0},
    "huge age": {"age": 1e300},
    "huge age, plain counts": {"half_life": None, "age": 1e300},
    "smaller budget": {"max_nodes": 10},
    "no budget": {"max_nodes": None},
    "any tokenizer text": {"tokenizer_id": "not a fingerprint"},
    "longest n-grams": {"ngram_length": 256},
    "huge tokens learned": {"tokens_learned": 10**30},
}
"""Settings a save never writes that load harmlessly (TokenTrie.load rescales a large age away)."""


def _column_edits() -> list[tuple[str, Edit, str]]:
    return [
        ("parent is itself", _set("parent", 3, 4), "parent 4 must come before"),
        ("parent comes later", _set("parent", 3, 9), "parent 9 must come before"),
        ("negative parent", _set("parent", 3, -2), "parent -2 must come before"),
        ("token below 0", _set("token", 2, -1), "token id -1"),
        ("token past 2**24", _set("token", 2, 1 << 24), "token id 16777216"),
        ("zero count", _set("count", 5, 0), "count 0"),
        ("negative count", _set("count", 5, -3), "count -3"),
        ("count past 2**53", _set("count", 0, 1 << 60), "count 1152921504606846976"),
        ("count above the parent's", _above_parent, "must not exceed its parent's"),
        ("nan weight", _set("weight", 1, float("nan")), "weight nan"),
        ("infinite weight", _set("weight", 1, float("inf")), "weight inf"),
        ("negative weight", _set("weight", 1, -1.0), "weight -1.0"),
        ("weight no count can make", _set("weight", 1, 1e300), "larger than its count"),
        ("no source", _set("source", 0, 0), "source flags 0"),
        ("prompt source", _set("source", 0, 4), "source flags 4"),
        ("unknown source", _set("source", 0, 255), "source flags 255"),
        ("n-gram stored twice", _twin, "stored twice"),
        ("n-gram longer than the n-gram length", _chain, "5-gram, longer than its n-gram length 4"),
        ("n-gram length below the depth", _setting("ngram_length", 3), "4-gram, longer than its n-gram length 3"),
        ("columns of different lengths", _shorter, "differ in length"),
        ("token as int64", _cast("token", np.int64), "column token is 1-d int64"),
        ("weight as float32", _cast("weight", np.float32), "column weight is 1-d float32"),
        ("count as float", _cast("count", np.float64), "column count is 1-d float64"),
        ("2-d parent", _cast("parent", np.int32, (1, -1)), "column parent is 2-d"),
        ("missing column", _drop("source"), "columns \\['count'"),
        ("model_next token below 0", _set("model_next", 0, [3, -1]), "model's choices hold a token id out of"),
        ("model_next token past 2**24", _set("model_next", 1, [1 << 24, 3]), "model's choices hold a token id out"),
        ("model_next token stored twice", _next_twice, "model's choices name a token twice"),
        ("model_next as int64", _cast("model_next", np.int64, (-1, 2)), "model's choices are a 2-d int64"),
        ("model_next 1-d", _cast("model_next", np.int32), "model's choices are a 1-d int32"),
        ("extra column", _extra, "'pickle'"),
        ("settings a list", _replace([4, [0]]), "not a record"),
        ("settings text", _replace("ngram_length=4"), "not a record"),
        ("settings with an extra field", lambda c, r: {**r, "evil": 1}, "not a record"),
        *[(f"no {name}", _missing(name), "not a record") for name in ("age", "ngram_length")],
        *[
            (f"{name} {value!r}", _setting(name, value), re.escape(name))
            for name, values in BAD_SETTINGS.items()
            for value in values
        ],
    ]


def _header_payloads(columns: dict[str, np.ndarray], record: dict) -> list[tuple[str, bytes, str]]:
    """Payloads with crafted safetensors headers, each with what its refusal must say."""
    good = trie_payload(columns, record)
    (length,) = struct.unpack_from("<Q", good)
    header = json.loads(good[8 : 8 + length])
    data = good[8 + length :]
    name = "token"
    start, end = header[name]["data_offsets"]

    def tensor(**changes: object) -> bytes:
        return raw_payload({**header, name: {**header[name], **changes}}, data)

    settings_text = json.dumps(record)
    return [
        ("7-byte payload", b"\x07" * 7, "7-byte payload has no room"),
        ("empty payload", b"", "0-byte payload"),
        ("huge header length", struct.pack("<Q", 1 << 63) + good[8:], "safetensors header of 9223372036854775808"),
        ("header past the payload", struct.pack("<Q", len(good) - 7) + good[8:], "safetensors header of"),
        ("header over a megabyte", raw_payload(b" " * (1 << 20 | 1)), "safetensors header of 1048577"),
        ("header not JSON", raw_payload(b"{not json"), "the safetensors header: not JSON"),
        ("header not UTF-8", raw_payload(b'{"\xff\xfe": 1}'), "the safetensors header: not JSON"),
        ("header nested 100k deep", raw_payload(nested(100_000).encode()), "safetensors header: JSON nested too"),
        ("header a list", raw_payload([1, 2]), "not a JSON object"),
        ("no metadata", raw_payload({k: v for k, v in header.items() if k != "__metadata__"}, data), "no lookahead"),
        ("metadata a number", raw_payload({**header, "__metadata__": 5}, data), "no lookahead-trie settings"),
        ("settings a number", raw_payload({**header, "__metadata__": {"lookahead-trie": 4}}, data), "no lookahead"),
        ("settings nested 100k deep", raw_payload(_with_settings(header, nested(100_000)), data), "nested too"),
        ("settings not JSON", raw_payload(_with_settings(header, settings_text[:-1]), data), "settings: not JSON"),
        ("offsets past the data", tensor(data_offsets=[start, len(data) + 64]), "malformed trie file"),
        ("offsets reversed", tensor(data_offsets=[end, start]), "malformed trie file"),
        ("shape not matching offsets", tensor(shape=[(end - start) // 4 + 1]), "malformed trie file"),
        ("huge shape", tensor(shape=[1 << 62, 1 << 62]), "malformed trie file"),
        ("unknown dtype", tensor(dtype="Q99"), "malformed trie file"),
        ("data missing", raw_payload(header), "malformed trie file"),
    ]


def _with_settings(header: dict, text: str) -> dict:
    return {**header, "__metadata__": {"lookahead-trie": text}}


def hostile_files() -> list[tuple[str, bytes, str]]:
    """(name, file contents, regex its refusal must match) for every class of crafted file."""
    columns, record, good = *sample_parts(), GOOD
    rng = np.random.default_rng(17)
    cases = []
    for offset in sorted({0, 7, 8, 12, 19, 20, 51, *range(52, len(good), max(1, len(good) // 60))}):
        expected = "not a lookahead trie file" if offset < _PREFIX.size else "truncated or padded"
        cases.append((f"truncated at {offset}", good[:offset], expected))
    cases.append(("padded", good + b"\0", "truncated or padded"))
    for position in rng.choice(len(good), 40, replace=False):
        flipped = bytearray(good)
        flipped[position] ^= int(rng.integers(1, 256))
        cases.append((f"byte {position} flipped", bytes(flipped), "bad magic|version|truncated or padded|corrupted"))
    for name, payload, expected in _header_payloads(columns, record):
        cases.append((name, container(payload), expected))
    for name, edit, expected in _column_edits():
        changed, settings_record = {k: v.copy() for k, v in columns.items()}, dict(record)
        replaced = edit(changed, settings_record)
        cases.append(
            (name, container(trie_payload(changed, settings_record if replaced is None else replaced)), expected)
        )
    return cases


_CASES = hostile_files()


# ---- refusals -----------------------------------------------------------------------------


def _refusal(path: Path) -> str:
    with pytest.raises(ValueError) as refused:
        TokenTrie.load(path)
    message = str(refused.value)
    assert message.startswith(f"{path}:") and "\n" not in message
    return message


@pytest.mark.parametrize(("contents", "expected"), [case[1:] for case in _CASES], ids=[case[0] for case in _CASES])
def test_a_crafted_file_is_refused_saying_why(tmp_path, contents, expected):
    path = tmp_path / "trie.bin"
    path.write_bytes(contents)
    assert re.search(expected, _refusal(path))


def test_the_generator_covers_every_class():
    names = " | ".join(case[0] for case in _CASES)
    assert len(_CASES) > 200
    for kind in ("truncated", "flipped", "header", "settings", "parent", "weight", "count", "source", "column"):
        assert kind in names, kind


@pytest.mark.parametrize(("name", "changes"), ODD_BUT_HARMLESS.items(), ids=list(ODD_BUT_HARMLESS))
def test_odd_settings_load_harmlessly(tmp_path, name, changes):
    columns, record = sample_parts()
    path = tmp_path / "odd"
    path.write_bytes(container(trie_payload(columns, {**record, **changes})))
    still_works(TokenTrie.load(path), tmp_path)


def test_a_column_newer_than_the_files_version_is_refused(tmp_path):
    columns, record = sample_parts()
    payload = trie_payload(columns, record)
    path = tmp_path / "v2-with-model-next"
    path.write_bytes(_PREFIX.pack(MAGIC, 2, len(payload), hashlib.sha256(payload).digest()) + payload)
    assert "model_next" in _refusal(path)
    del columns["model_next"]
    payload = trie_payload(columns, record)
    path.write_bytes(_PREFIX.pack(MAGIC, 2, len(payload), hashlib.sha256(payload).digest()) + payload)
    still_works(TokenTrie.load(path), tmp_path)  # a version 2 file: nothing known of the model's choices yet


def test_token_ids_outside_the_vocabulary_are_refused_when_bound(tmp_path):
    columns, record = sample_parts()
    columns["token"][3] = VOCAB
    columns["model_next"][0, 1] = VOCAB + 1
    path = tmp_path / "big-vocabulary"
    path.write_bytes(container(trie_payload(columns, record)))
    trie = TokenTrie.load(path)  # the file alone is sound: only a model can say which ids it has
    trie.check_vocabulary(VOCAB + 2)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: token id {VOCAB + 1} is outside .* of {VOCAB}"):
        trie.check_vocabulary(VOCAB)
    built = TokenTrie(ngram_length=2)
    built.insert([7])
    with pytest.raises(ValueError, match=r"^the trie: token id 7"):
        built.check_vocabulary(7)


def test_not_a_regular_file_is_refused_without_reading(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    zeros = tmp_path / "zeros"
    zeros.symlink_to("/dev/zero")  # reading it would never end
    for path in (tmp_path, fifo, zeros):
        assert "not a regular file" in _refusal(path)
    assert "cannot read the trie file (No such file" in _refusal(tmp_path / "missing")


# ---- what loads still works ---------------------------------------------------------------


def still_works(trie: TokenTrie, tmp: Path) -> None:
    """What generation asks of a trie: it drafts sound trees, learns with decay and eviction, saves and loads back."""
    _check_structure(trie._shared)
    trie.insert(list(range(1, 30)), request="r")
    for context in ([1, 2], [5, 6, 7], [0], [3]):
        tree = trie.retrieve(context, 8, 4, request="r")
        assert len(tree) <= 8 and all(0 < score <= 1 for score in tree.scores)
    trie.observe("r", [int(t) for t in np.random.default_rng(3).integers(1, 40, 150)])
    trie.finish("r")
    _check_structure(trie._shared)
    assert trie.max_nodes is None or len(trie) <= trie.max_nodes
    trie.save(tmp / "again")
    again = TokenTrie.load(tmp / "again")
    assert _ngrams(again._shared) == _ngrams(trie._shared)
    assert (again.ngram_length, again.boundary_ids, again.max_nodes) == (
        trie.ngram_length, trie.boundary_ids, trie.max_nodes
    )  # fmt: skip


def _load_or_refuse(path: Path, tmp: Path) -> None:
    """Refused with a message that names the file (at load, or when bound to VOCAB), or it still works."""
    try:
        trie = TokenTrie.load(path)
        trie.check_vocabulary(VOCAB)
    except ValueError as err:
        assert str(err).startswith(f"{path}:")
        return
    still_works(trie, tmp)


def _mutated(changes: list[tuple[int, int]], fix_checksum: bool) -> bytes:
    """GOOD with bytes set, and with its checksum made to match again if `fix_checksum`."""
    data = bytearray(GOOD)
    for position, value in changes:
        data[position] = value
    if fix_checksum:
        data[: _PREFIX.size] = container(bytes(data[_PREFIX.size :]), length=len(GOOD) - _PREFIX.size)[: _PREFIX.size]
    return bytes(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    st.booleans(),
    st.one_of(st.none(), st.integers(0, len(GOOD) - 1)),
)
def test_arbitrary_byte_changes_are_refused_or_harmless(tmp_path, changes, fix_checksum, cut):
    path = tmp_path / "mutated"
    path.write_bytes(_mutated(changes, fix_checksum)[:cut])
    _load_or_refuse(path, tmp_path)


def test_every_header_byte_changed_is_refused_or_harmless(tmp_path):
    (length,) = struct.unpack_from("<Q", GOOD, _PREFIX.size)
    header = range(_PREFIX.size, _PREFIX.size + 8 + length)
    path = tmp_path / "mutated"
    for position in header:
        for value in (GOOD[position] ^ 0x01, GOOD[position] ^ 0x80, ord("[")):
            path.write_bytes(_mutated([(position, value)], fix_checksum=True))
            _load_or_refuse(path, tmp_path)


# ---- bounded time and memory ------------------------------------------------------------------

_MEASURE = """
import json, resource, sys, time
from lookahead.drafting.trie import TokenTrie
TokenTrie.load(sys.argv[1])  # a sound file first: every module a load imports is in
rows = []
for path in sys.argv[2:]:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        TokenTrie.load(path)
        message = None
    except ValueError as err:
        message = str(err)
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    rows.append({"path": path, "seconds": seconds, "grown_kb": grown, "message": message})
print(json.dumps(rows))
"""


def measure_loads(sound: Path, paths: list[Path]) -> list[dict]:
    """Time and peak-memory growth of loading each of `paths`, in a fresh interpreter (a hang fails by timeout)."""
    command = [sys.executable, "-c", _MEASURE, str(sound), *map(str, paths)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(result.stdout)


def test_huge_and_endless_files_are_refused_fast_without_reading_them(tmp_path):
    sound = tmp_path / "sound"
    sound.write_bytes(GOOD)
    sparse = tmp_path / "sparse-declared"  # a sound prefix that declares 1.5 GB, all of it a hole
    size = 1_500_000_000
    sparse.write_bytes(_PREFIX.pack(MAGIC, VERSION, size - _PREFIX.size, bytes(32)))
    os.truncate(sparse, size)
    padded = tmp_path / "sparse-padded"  # a sound file followed by 1.5 GB of hole
    padded.write_bytes(GOOD)
    os.truncate(padded, size)
    zeros, fifo = tmp_path / "zeros", tmp_path / "fifo"
    zeros.symlink_to("/dev/zero")
    os.mkfifo(fifo)
    rows = measure_loads(sound, [sparse, padded, zeros, fifo])
    expected = [f"over the limit of {MAX_PAYLOAD_BYTES}", "truncated or padded", "not a regular", "not a regular"]
    for row, says in zip(rows, expected, strict=True):
        assert row["message"] and says in row["message"], row
        assert row["seconds"] < 1.0 and row["grown_kb"] < 50_000, row


def test_an_engine_decodes_exactly_from_an_odd_but_accepted_file(tmp_path):
    from conftest import hf_greedy
    from tiny_models import tiny_model

    from lookahead import LookaheadConfig, LookaheadEngine
    from lookahead.drafting.triefile import TrieSettings, write_trie

    model = tiny_model("llama")
    ids = [5, 17, 99, 3, 250, 17, 99]
    expected = hf_greedy(model, ids, 40)
    learned = TokenTrie(ngram_length=8)
    learned.insert(ids + expected)  # drafts from it are the model's own continuation
    learned.save(tmp_path / "learned")
    columns, saved = read_trie(tmp_path / "learned")
    odd = TrieSettings(**{**asdict(saved), "half_life": 1e-300, "age": 1e300, "max_nodes": len(learned) - 5})
    write_trie(tmp_path / "odd", columns, odd)
    engine = LookaheadEngine(model, None, LookaheadConfig(policy="fixed"), trie=TokenTrie.load(tmp_path / "odd"))
    out = engine.generate(ids, 40)
    assert out.token_ids == expected
    assert sum(n * steps for n, steps in out.stats.accepted_histogram.items()) > 0  # the file's drafts were used
