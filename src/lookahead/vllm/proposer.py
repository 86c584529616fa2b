"""The class vLLM's `custom_class` speculative method instantiates in each worker process.

One trie per worker process, built from the LOOKAHEAD_VLLM settings (or loaded from the
trie file), shared by every request that worker runs; the file is saved every few minutes
while answers arrive, and at shutdown.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..drafting.drafter import TrieDrafting
from ..server.persistence import TrieSaver, load_trie
from . import Settings
from .chains import ChainDrafting
from .runner import calling_runner, check_version, read_batch

log = logging.getLogger("lookahead.vllm")


class LookaheadProposer:
    """vLLM's proposer: `propose` returns each running request's draft chain (maybe empty)."""

    def __init__(self, vllm_config: Any) -> None:
        import vllm

        check_version(vllm.__version__)
        settings = Settings.from_environment()
        trie = load_trie(settings.trie_path)
        if trie is not None:
            log.info("lookahead: trie loaded from %s (%d nodes)", settings.trie_path, len(trie))
        drafting = TrieDrafting.from_config(settings.config, _eos_ids(vllm_config.model_config), trie=trie)
        self.chains = ChainDrafting(drafting, vllm_config.speculative_config.num_speculative_tokens)
        if settings.trie_path is not None:
            saver = TrieSaver(drafting.trie, settings.trie_path, settings.save_every_s, lambda: self.chains.closed)
            threading.Thread(target=_save_periodically, args=(saver,), name="lookahead-trie-saver", daemon=True).start()
            atexit.register(saver.save)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's CPU runner hands its drafter the model; Lookahead drafts without one."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        runner, scheduler_output = calling_runner()
        return self.chains.propose(read_batch(runner, scheduler_output, sampled_token_ids))


def _save_periodically(saver: TrieSaver) -> None:
    while True:
        time.sleep(saver.every_s)
        if saver.changed():
            saver.save()


def _eos_ids(model_config: Any) -> frozenset[int]:
    """The model's end-of-turn ids (the trie's n-gram boundaries), from its generation config or tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    from ..models import eos_ids

    try:
        generation = GenerationConfig.from_pretrained(model_config.model)
    except OSError:
        generation = GenerationConfig()
    return eos_ids(generation, AutoTokenizer.from_pretrained(model_config.tokenizer))
