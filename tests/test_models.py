"""load_model: the bundled default, its conversion cache, and every kind of bad input."""

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from tiny_models import tiny_gguf

from lookahead import load_model, models
from lookahead.config import cache_dir
from lookahead.models import pretrained_directory


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_default_model_is_cached_as_safetensors(default_model):
    model, tokenizer = default_model
    assert model.config.model_type == "llama" and not model.training
    entry = cache_dir() / "models" / "smollm2-135m"
    record = json.loads((entry / "lookahead-complete.json").read_text())
    assert "model.safetensors" in record["files"]
    assert tokenizer.chat_template


def test_a_bundled_model_as_a_directory_for_other_engines(default_model):
    directory = pretrained_directory()
    assert directory == cache_dir() / "models" / "smollm2-135m"  # the conversion load_model made
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
    with pytest.raises(ValueError, match="not a bundled model"):
        pretrained_directory("./my-model")


def test_unknown_name(private_cache):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model("./missing/model.gguf")


def test_corrupt_gguf(tmp_path, private_cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    with pytest.raises(ValueError, match="not a readable GGUF model"):
        load_model(bad)
    assert not any((private_cache / "models").glob("broken-*")), "no half-made cache entry is left"


def test_gguf_of_unsupported_architecture(tmp_path, private_cache):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "nosucharch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported model architecture"):
        load_model(path)


def test_directory_of_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        load_model(tmp_path)


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(tmp_path)


def test_bad_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(dtype="float8")


@pytest.mark.slow
def test_concurrent_conversions_then_corrupt_entry_is_rebuilt(tmp_path, private_cache):
    source = tiny_gguf(tmp_path / "tiny.gguf")
    load = f"from lookahead import load_model; m, t = load_model({str(source)!r}); print(m.config.model_type)"
    env = {"LOOKAHEAD_CACHE": str(private_cache), "PATH": "/usr/bin:/bin"}
    racers = [subprocess.Popen([sys.executable, "-c", load], env=env, stdout=subprocess.PIPE) for _ in range(2)]
    assert [r.communicate(timeout=300)[0].strip() for r in racers] == [b"llama", b"llama"]
    assert all(r.returncode == 0 for r in racers)
    entries = list((private_cache / "models").iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("tiny-"), "one entry, no leftover temporary directories"
    weights = entries[0] / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])  # a half-written file
    model, tokenizer = load_model(source)  # in this process, on the same private cache
    assert model.config.model_type == "llama" and len(tokenizer) == model.config.vocab_size
    assert weights.stat().st_size == size and list((private_cache / "models").iterdir()) == entries


def test_a_gguf_file_rewritten_in_place_leaves_one_conversion_behind(tmp_path, private_cache):
    source = tiny_gguf(tmp_path / "tiny.gguf")
    load_model(source)
    (tmp_path / "other.gguf").write_bytes(b"another model")
    records = {"other-1": {"source": str(tmp_path / "other.gguf"), "version": "other-1"}, "made-before": {}}
    for name, record in records.items():  # another file's entry, and one of before sources were recorded
        (private_cache / "models" / name).mkdir()
        (private_cache / "models" / name / "lookahead-complete.json").write_text(json.dumps({**record, "files": {}}))
    first = {entry.name for entry in (private_cache / "models").iterdir()}
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file is written again
    model, _ = load_model(source)
    assert model.config.model_type == "llama"
    now = {entry.name for entry in (private_cache / "models").iterdir()}
    gone, added = first - now, now - first
    assert len(gone) == 1 and gone.pop().startswith("tiny-") and len(added) == 1 and added.pop().startswith("tiny-")
    assert {"other-1", "made-before"} <= now


def test_the_entries_of_a_deleted_file_go_when_the_cache_next_grows(tmp_path, private_cache):
    write = lambda out: (out / "model.gguf").write_bytes(b"converted")  # noqa: E731 (a stand-in converter)
    deleted, kept = tmp_path / "deleted.gguf", tmp_path / "kept.gguf"
    for source in (deleted, kept):
        source.write_bytes(b"weights")
    old = [models._cached("gguf", f"{source.stem}-v1", write, source) for source in (deleted, kept)]
    deleted.unlink()
    assert old[0].is_dir(), "nothing is removed until the cache grows"
    (tmp_path / "new.gguf").write_bytes(b"weights")
    models._cached("gguf", "new-v1", write, tmp_path / "new.gguf")
    assert not old[0].exists() and old[1].is_dir()


def test_conversions_of_one_file_to_several_types_are_all_kept(tmp_path, private_cache):
    source = tmp_path / "weights.gguf"
    source.write_bytes(b"one version")
    write = lambda out: (out / "model.gguf").write_bytes(b"converted")  # noqa: E731 (a stand-in converter)
    kept = [models._cached("gguf", f"weights-v1-{kind}", write, source, "weights-v1") for kind in ("f16", "q8_0")]
    assert all(entry.is_dir() for entry in kept)
    newer = models._cached("gguf", "weights-v2-f16", write, source, "weights-v2")
    assert not any(entry.exists() for entry in kept) and (newer / "model.gguf").read_bytes() == b"converted"
