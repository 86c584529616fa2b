"""The class vLLM's `custom_class` speculative method instantiates in each worker process.

One trie per worker process, built from the LOOKAHEAD_VLLM settings (or loaded from the
trie file), shared by every request that worker runs. The file is saved when the worker's
drafting pauses (QUIET_S), every `save_every_s` while it does not, and as the worker ends:
vLLM's shutdown gives a worker a few seconds before killing it, too short to count on for the
only save, and it never tells a proposer it is stopping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.util import Finalize
from typing import Any

from ..decoding.transcript import eos_ids
from ..drafting.drafter import TrieDrafting
from ..server.persistence import TrieSaver, load_trie
from . import Settings
from .chains import ChainDrafting
from .runner import calling_runner, check_version, read_batch

log = logging.getLogger("lookahead.vllm")
QUIET_S = 1.0
"""A worker whose proposer has not been called for this long is between bursts: what it learned is saved then."""
QUIET_SAVE_SHARE = 0.1
"""Saves between bursts take at most this share of the time: a large trie takes seconds to write, and bursts a few
seconds apart must not keep a core writing it."""


class LookaheadProposer:
    """vLLM's proposer: `propose` returns each running request's draft chain (maybe empty)."""

    def __init__(self, vllm_config: Any) -> None:
        import vllm

        check_version(vllm.__version__)
        settings = Settings.from_environment()
        model_config = vllm_config.model_config
        tokenizer = _tokenizer(model_config)
        trie = load_trie(settings.trie_path)
        if trie is not None:
            log.info("lookahead: trie loaded from %s (%d nodes)", settings.trie_path, len(trie))
        drafting = TrieDrafting.from_config(settings.config, _eos_ids(model_config, tokenizer), trie=trie)
        drafting.trie.bind_tokenizer(tokenizer)  # a trie saved with another tokenizer is refused here
        drafting.trie.check_vocabulary(model_config.get_vocab_size())  # and one with ids the model lacks
        self.chains = ChainDrafting(drafting, vllm_config.speculative_config.num_speculative_tokens)
        self.called_at = time.monotonic()
        """When vLLM last asked for drafts (monotonic seconds)."""
        if settings.trie_path is not None:
            trie = drafting.trie
            learned = lambda: trie.stats()["tokens_learned"]  # noqa: E731 (moves whenever the shared index may change)
            saver = TrieSaver(trie, settings.trie_path, settings.save_every_s, learned)
            stop = threading.Event()
            args = (saver, stop, lambda: self.called_at)
            periodic = threading.Thread(target=_save_periodically, args=args, name="lookahead-trie-saver")
            periodic.daemon = True
            periodic.start()
            # Run as the worker process ends, forked or spawned (a forked child skips atexit), and in the main one.
            Finalize(None, _save_at_exit, args=(saver, stop, periodic), exitpriority=10)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's CPU runner hands its drafter the model; Lookahead drafts without one."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        runner, scheduler_output = calling_runner()
        try:
            return self.chains.propose(read_batch(runner, scheduler_output, sampled_token_ids))
        finally:
            self.called_at = time.monotonic()


def _save_periodically(saver: TrieSaver, stop: threading.Event, called_at: Callable[[], float]) -> None:
    """Save what was learned once drafting has paused for QUIET_S (no more often than QUIET_SAVE_SHARE of the time
    allows), and every `saver.every_s` while it runs on."""
    saved_at, took = time.monotonic(), 0.0
    while not stop.wait(QUIET_S / 2):
        now = time.monotonic()
        quiet = now - called_at() >= QUIET_S and now - saved_at >= took / QUIET_SAVE_SHARE
        if (quiet or now - saved_at >= saver.every_s) and saver.changed():
            saver.save()
            saved_at = time.monotonic()
            took = saved_at - now


def _save_at_exit(saver: TrieSaver, stop: threading.Event, periodic: threading.Thread) -> None:
    """The last save, after any periodic one under way (an older snapshot must not replace it)."""
    stop.set()
    periodic.join(timeout=60)
    saver.save()


def _tokenizer(model_config: Any) -> Any:
    """The tokenizer vLLM serves the model with (the trie file's tokens are its ids)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model_config.tokenizer,
        revision=getattr(model_config, "tokenizer_revision", None),
        trust_remote_code=getattr(model_config, "trust_remote_code", False),
    )


def _eos_ids(model_config: Any, tokenizer: Any) -> frozenset[int]:
    """The model's end-of-turn ids (the trie's n-gram boundaries), from its generation config or tokenizer."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(
            model_config.model, revision=getattr(model_config, "revision", None)
        )
    except OSError:
        generation = GenerationConfig()
    return eos_ids(generation, tokenizer)
