"""load_model: the bundled default, its conversion cache, and every kind of bad input."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from lookahead import load_model
from lookahead.models import cache_dir


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


_LOAD = "from lookahead import load_model; m, t = load_model(); print(m.config.model_type)"


@pytest.mark.slow
def test_concurrent_conversions_then_corrupt_entry_is_rebuilt(private_cache):
    env = {"LOOKAHEAD_CACHE": str(private_cache), "PATH": "/usr/bin:/bin"}
    racers = [subprocess.Popen([sys.executable, "-c", _LOAD], env=env, stdout=subprocess.PIPE) for _ in range(2)]
    assert [r.communicate(timeout=300)[0].strip() for r in racers] == [b"llama", b"llama"]
    assert all(r.returncode == 0 for r in racers)
    entries = list((private_cache / "models").iterdir())
    assert [e.name for e in entries] == ["smollm2-135m"], "one entry, no leftover temporary directories"
    weights = entries[0] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a half-written file
    rebuilt = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, timeout=300)
    assert rebuilt.returncode == 0 and rebuilt.stdout.strip() == b"llama"
    assert weights.stat().st_size > 100_000_000
