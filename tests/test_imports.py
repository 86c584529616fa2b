"""The house's import rules: the drafting core, sharing and the step loop never load torch (or Ray); `import
lookahead` is cheap."""

import subprocess
import sys

import pytest

TORCH_FREE = [
    "lookahead",
    "lookahead.config",
    "lookahead.drafting.ngrams",
    "lookahead.drafting.trie",
    "lookahead.drafting.sources",
    "lookahead.drafting.prompt_index",
    "lookahead.drafting.tree",
    "lookahead.drafting.policy",
    "lookahead.drafting.drafter",
    "lookahead.drafting.triefile",
    "lookahead.decoding.step",
    "lookahead.decoding.batch",
    "lookahead.decoding.transcript",
    "lookahead.decoding.costs",
    "lookahead.bench.replay",
    "lookahead.bench.sharing",
    "lookahead.sharing",
]


def _loaded_after(code: str) -> set[str]:
    """Top-level modules loaded by a fresh interpreter after running `code`."""
    probe = f"{code}\nimport sys; print(' '.join(sorted({{name.split('.')[0] for name in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(result.stdout.split())


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch_or_transformers(module):
    assert not _loaded_after(f"import {module}") & {"torch", "transformers", "ray"}


def test_a_trie_is_built_used_and_saved_without_torch(tmp_path):
    code = f"""
from lookahead import DraftTree, LookaheadConfig, TokenTrie
trie = TokenTrie.from_config(LookaheadConfig(), [0])
trie.observe("r", [1, 2, 3, 4, 1, 2, 3])
assert isinstance(trie.retrieve([1, 2], 4, 4), DraftTree)
trie.save({str(tmp_path / "t")!r})
assert len(TokenTrie.load({str(tmp_path / "t")!r})) == len(trie)
"""
    assert not _loaded_after(code) & {"torch", "transformers"}


def test_the_engine_is_loaded_on_first_use():
    assert "torch" in _loaded_after("from lookahead import LookaheadEngine")


def test_every_public_name_resolves_from_its_home():
    import lookahead

    assert sorted(lookahead.__all__) == sorted(lookahead._HOMES)
    for name in lookahead.__all__:
        assert getattr(lookahead, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        lookahead.Engine  # noqa: B018
