"""`lookahead trie build | inspect`, and an engine started warm from a built file."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from lookahead.cli import main
from lookahead.drafting.trie import TokenTrie
from lookahead.drafting.triefile import tokenizer_fingerprint


@pytest.fixture
def offline_model(default_model, monkeypatch):
    """The session's default model, so the command does not load it again."""
    monkeypatch.setattr("lookahead.load_model", lambda name=None, **_: default_model)
    return default_model


def test_build_then_inspect(offline_model, tmp_path, capsys):
    _, tokenizer = offline_model
    corpus = tmp_path / "answers.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"The answer is {n} apples in total."}) for n in range(5)) + "\n\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("Natalia sold clips to 48 of her friends.\n" * 3)
    out = tmp_path / "warm.trie"
    assert main(["trie", "build", str(corpus), str(notes), "-o", str(out), "--max-nodes", "5000"]) == 0
    trie = TokenTrie.load(out)
    assert trie.tokenizer_id == tokenizer_fingerprint(tokenizer) and trie.max_nodes == 5000
    assert trie.sources()["corpus"] == len(trie) > 0
    ids = tokenizer.encode("The answer is", add_special_tokens=False)
    drafted = trie.retrieve(ids, 8, 8)
    assert tokenizer.decode(drafted.tokens[:2]).strip() in {str(n) for n in range(5)}
    capsys.readouterr()
    assert main(["trie", "inspect", str(out), "--length", "3", "--top", "3"]) == 0
    shown = capsys.readouterr().out
    assert f"nodes           {len(trie)}" in shown
    assert f"corpus {len(trie)}" in shown
    assert "recycled        none" in shown  # a corpus has no model's next tokens
    assert "model's choices 0 tokens" in shown  # nor says what a model chose
    assert shown.count("          5  ") == 3 and '" apples in total"' in shown  # decoded, most frequent first


def test_build_reports_user_mistakes(offline_model, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no text field"}\n')
    assert main(["trie", "build", str(bad), "-o", str(tmp_path / "t")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["trie", "build", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "t")]) == 2
    (tmp_path / "junk").write_bytes(b"not a trie")
    assert main(["trie", "inspect", str(tmp_path / "junk")]) == 2
    assert "not a lookahead trie file" in capsys.readouterr().err
    notes = tmp_path / "notes.txt"
    notes.write_text("some text\n")
    for output in (tmp_path, tmp_path / "no-such-dir" / "t"):
        assert main(["trie", "build", str(notes), "-o", str(output)]) == 2
        assert "not a file name in an existing directory" in capsys.readouterr().err


def test_engine_starts_warm_from_a_built_file(offline_model, tmp_path):
    from tiny_models import tiny_model

    from lookahead import LookaheadConfig, LookaheadEngine

    _, tokenizer = offline_model
    model = tiny_model("llama", vocab_size=len(tokenizer))  # the file's ids are the tokenizer's: all must embed
    text = "def add(a, b):\n    return a + b\n"
    (tmp_path / "code.txt").write_text(text)
    assert main(["trie", "build", str(tmp_path / "code.txt"), "-o", str(tmp_path / "t")]) == 0
    engine = LookaheadEngine(model, tokenizer, LookaheadConfig(policy="fixed"), trie=TokenTrie.load(tmp_path / "t"))
    ids = tokenizer.encode("def add(a, b):", add_special_tokens=False)
    assert tokenizer.decode(engine.trie.retrieve(ids, 8, 8).tokens).startswith("\n    return a + b")


def _no_model(*args, **kwargs):
    raise AssertionError("a bad trie file must be refused before the model loads")


def _chain_file(path, nodes: int) -> None:
    """A sound container holding one path of `nodes` nodes: far deeper than any n-gram length allows."""
    from lookahead.drafting.triefile import TrieSettings, write_trie

    ones = np.ones(nodes, dtype=np.int64)
    columns = {"token": ones, "parent": np.arange(nodes), "count": ones, "weight": ones, "source": ones}
    settings = TrieSettings(256, [], None, None, 0.0, nodes, None)
    write_trie(path, columns, settings)


def test_hostile_files_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("lookahead.load_model", _no_model)
    chain = tmp_path / "chain.trie"
    _chain_file(chain, 200_000)
    start = time.perf_counter()
    assert main(["trie", "inspect", str(chain)]) == 2
    assert time.perf_counter() - start < 10  # it took 71 s to get through the depths of this chain
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    assert main(["trie", "build", str(corpus), "-o", str(tmp_path / "out"), "--into", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"lookahead: error: {chain}: malformed trie file (it holds a 200000-gram, longer than its n-gram length 256)",
        f"lookahead: error: {tmp_path}: not a regular file (a directory, a pipe or a device), so not a trie file",
    ]


def test_inspect_of_a_directory_exits_2_without_a_traceback(tmp_path):
    command = [sys.executable, "-m", "lookahead.cli", "trie", "inspect", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"lookahead: error: {tmp_path}: not a regular file (a directory, a pipe or a device), so not a trie file"
    ]
