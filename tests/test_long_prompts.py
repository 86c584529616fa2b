"""Long prompts end to end: documentation questions of thousands of tokens, and a 32k-token prompt."""

import numpy as np
import pytest
from conftest import hf_greedy
from tiny_models import VOCAB, tiny_model

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.bench.longdocs import doc_question

pytestmark = pytest.mark.slow


def test_a_documentation_question_of_2k_tokens_equals_generate(default_model):
    model, tokenizer = default_model
    engine = LookaheadEngine(model, tokenizer)  # fresh: the first request a service sees

    def count(text: str) -> int:
        return len(engine.chat_ids([{"role": "user", "content": text}]))

    ids = engine.chat_ids([{"role": "user", "content": doc_question(count, 2048)}])
    assert 2048 - 64 <= len(ids) <= 2048
    out = engine.generate(ids, max_new_tokens=40)
    assert out.token_ids == hf_greedy(model, ids, 40)
    assert out.stats.draft_tokens > 0, "the answer quotes its document: drafts are tried"


def test_a_32k_token_prompt_equals_generate():
    model = tiny_model("llama", max_position_embeddings=40_000)
    rng = np.random.default_rng(0)
    passages = [rng.integers(3, VOCAB, size=400).tolist() for _ in range(20)]
    prompt = [t for i in rng.integers(0, len(passages), size=82) for t in passages[i]]  # repeats, as documents do
    assert len(prompt) == 32_800
    engine = LookaheadEngine(model, None, LookaheadConfig())
    out = engine.generate(prompt, max_new_tokens=24)
    assert out.token_ids == hf_greedy(model, prompt, 24)
    assert engine.trie.stats()["live_requests"] == 0, "the prompt's index is freed when the request ends"
