"""The settings users give the vLLM proposer: `speculative_config` and the LOOKAHEAD_VLLM variable."""

from __future__ import annotations

import json

import pytest

from lookahead.config import LookaheadConfig
from lookahead.vllm import ENVIRONMENT, PROPOSER, Settings, speculative_config


def test_speculative_config_names_the_proposer_and_exports_the_settings(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    monkeypatch.chdir(tmp_path)
    config = speculative_config(12, trie_path="trie.bin", trie_max_nodes=5000)
    assert config == {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 12}
    settings = Settings.from_environment()
    assert settings.config == LookaheadConfig(trie_max_nodes=5000)
    assert settings.trie_path == str(tmp_path / "trie.bin")  # absolute: vLLM's workers may start elsewhere


def test_the_proposer_path_imports_to_the_class() -> None:
    module, name = PROPOSER.rsplit(".", 1)
    from importlib import import_module

    assert getattr(import_module(module), name).__name__ == name


def test_no_variable_means_the_defaults(monkeypatch) -> None:
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    assert Settings.from_environment() == Settings()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not JSON"),
        ('{"trie": 1}', "config, trie_path and save_every_s only"),
        ('{"config": {"depth": 3}}', "LookaheadConfig fields only"),
        ('{"config": {"decoding_length": 0}}', "decoding_length must be a positive integer"),
        ('{"save_every_s": -1}', "save_every_s must be a positive number"),
    ],
)
def test_bad_settings_are_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.from_json(text)


def test_settings_round_trip() -> None:
    settings = Settings(LookaheadConfig(policy="fixed", recycled=0), "/tmp/t.bin", 60.0)
    assert Settings.from_json(settings.to_json()) == settings
    assert json.loads(settings.to_json())["config"]["policy"] == "fixed"


@pytest.mark.parametrize("tokens", [0, -3, 2.5])
def test_bad_speculative_token_counts_are_refused(tokens) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_config(tokens)
