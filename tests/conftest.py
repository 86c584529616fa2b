from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)
# Cost curves from one measuring pass, not five (decoding/costs.py): on a new machine the suite would
# otherwise spend minutes pricing steps whose prices no test checks. Commands the tests start inherit it.
os.environ.setdefault("LOOKAHEAD_COST_PASSES", "1")


@pytest.fixture
def one_thread():
    """Tiny models are all Python overhead: one thread avoids waking a second on every matmul.

    Per test, so that a module's later tests on the bundled model get both threads back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_model():
    """The bundled default model and tokenizer, loaded once for the whole run."""
    from lookahead import load_model

    return load_model()


@pytest.fixture(scope="session")
def model(default_model):
    return default_model[0]


@pytest.fixture(scope="session")
def tokenizer(default_model):
    return default_model[1]


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """The model's own greedy `generate()`: the reference every output must equal."""
    inputs = torch.tensor([ids])
    out = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.generation_config.pad_token_id or 0,
    )
    return out[0, len(ids) :].tolist()


BENCHMARK_SETS = ["humaneval", "gsm8k", "mtbench", "code-edit"]
PROMPTS_PER_SET = 4
REFERENCE_TOKENS = 24
"""Enough for a warm trie to draft, accept and compact several times a prompt; the suite runs it for 16
prompts, and the model's own generate() for them (about 100 ms a token here) is the suite's largest cost."""


@pytest.fixture(scope="session")
def greedy_references(default_model) -> dict[tuple[str, str], tuple[list[int], list[int]]]:
    """(prompt ids, the model's own greedy REFERENCE_TOKENS new tokens) of the first PROMPTS_PER_SET prompts of
    each benchmark set, the sets in turn.

    Computed once for the run; greedy output for fewer tokens is a prefix of it.
    """
    from lookahead.bench.datasets import load_prompts

    model, tokenizer = default_model
    by_set = [load_prompts([name], PROMPTS_PER_SET) for name in BENCHMARK_SETS]
    references = {}
    for prompt in (prompt for group in zip(*by_set, strict=True) for prompt in group):
        messages = [{"role": "user", "content": prompt.text}]
        ids = [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)]
        references[prompt.dataset, prompt.key] = (ids, hf_greedy(model, ids, REFERENCE_TOKENS))
    return references
