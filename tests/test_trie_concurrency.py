"""Several threads sharing one engine and one trie: exact outputs, no lost updates, no errors."""

import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from conftest import hf_greedy
from test_trie_store import _check_structure, _ngrams
from tiny_models import tiny_model

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.drafting.trie import TokenTrie


def test_threads_generating_with_one_engine_match_greedy_and_lose_no_updates(tokenizer):
    model = tiny_model("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(10)] * 3 for _ in range(8)]
    want = [hf_greedy(model, ids, 40) for ids in prompts]
    trie = TokenTrie(ngram_length=8, max_nodes=None)
    engine = LookaheadEngine(
        model, tokenizer, LookaheadConfig(decoding_length=8, branch_length=4, policy="fixed"), trie
    )
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda ids: engine.generate(ids, max_new_tokens=40), prompts))
    assert [out.token_ids for out in got] == want
    assert sum(out.stats.draft_tokens for out in got) > 0
    reference = TokenTrie(ngram_length=8, max_nodes=None)
    for i, output in enumerate(want):
        reference.observe(i, output)
    assert _ngrams(trie._shared) == _ngrams(reference._shared)  # every count of every thread landed
    assert trie.stats()["live_requests"] == 0


def test_threads_hammering_a_small_trie_keep_it_sound():
    trie = TokenTrie(ngram_length=6, max_nodes=300, half_life=50.0)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for request in range(40):
                key = (seed, request)
                trie.insert([rng.randrange(40) for _ in range(30)], request=key)
                for _ in range(10):
                    context = [rng.randrange(40) for _ in range(4)]
                    trie.retrieve(context, 16, 6, request=key)
                    trie.observe(key, [rng.randrange(40) for _ in range(3)])
                    assert len(trie) <= 300
                trie.finish(key)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: interleave inside trie calls
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert trie.stats()["evicted_nodes"] > 0 and trie.stats()["live_requests"] == 0
    _check_structure(trie._shared)
