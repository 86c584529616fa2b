"""Lookahead inside vLLM: the trie drafter and its cost policy as a vLLM speculative method.

    from vllm import LLM
    from lookahead.vllm import speculative_config

    llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", speculative_config=speculative_config(16))

vLLM loads the proposer (`LookaheadProposer`, proposer.py) by its dotted path in every
worker process and gives it only vLLM's own configuration, so Lookahead's settings travel
in the LOOKAHEAD_VLLM environment variable (JSON), which `speculative_config` sets for the
processes started after it; `vllm serve` users export it themselves (README).

- chains.py   ChainDrafting: per-request drafters over one trie, their chains cut together (no vLLM)
- runner.py   what is read of vLLM's model runner, for the tested vLLM versions only
- proposer.py LookaheadProposer: the class vLLM instantiates; the trie file loaded and saved
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..config import LookaheadConfig, is_finite_number

ENVIRONMENT = "LOOKAHEAD_VLLM"
PROPOSER = "lookahead.vllm.proposer.LookaheadProposer"
DEFAULT_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class Settings:
    """What the proposer in each vLLM worker is built from."""

    config: LookaheadConfig = field(default_factory=LookaheadConfig)
    trie_path: str | None = None
    """A trie file: loaded at start if it exists, saved when drafting pauses, every `save_every_s` while it does not,
    and at shutdown."""
    save_every_s: float = 300.0

    def __post_init__(self) -> None:
        if not (is_finite_number(self.save_every_s) and self.save_every_s > 0):
            raise ValueError(f"save_every_s must be a positive number of seconds, got {self.save_every_s!r}")
        if self.trie_path is not None and not isinstance(self.trie_path, str):
            raise ValueError(f"trie_path must be a path or None, got {self.trie_path!r}")

    def to_json(self) -> str:
        return json.dumps(
            {"config": asdict(self.config), "trie_path": self.trie_path, "save_every_s": self.save_every_s}
        )

    @classmethod
    def from_json(cls, text: str) -> Settings:
        """Settings from `to_json`'s text (any field may be left out); ValueError naming what is wrong."""
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{ENVIRONMENT} is not JSON: {err}") from None
        if not isinstance(record, dict) or not set(record) <= {"config", "trie_path", "save_every_s"}:
            raise ValueError(f"{ENVIRONMENT} must be an object with config, trie_path and save_every_s only")
        config = record.get("config", {})
        known = {f.name for f in fields(LookaheadConfig)}
        if not isinstance(config, dict) or not set(config) <= known:
            raise ValueError(f"{ENVIRONMENT}: config takes LookaheadConfig fields only ({', '.join(sorted(known))})")
        path = record.get("trie_path")
        if isinstance(path, str):
            path = os.path.abspath(path)  # each worker resolves it alike, wherever it starts
        return cls(LookaheadConfig(**config), path, record.get("save_every_s", 300.0))

    @classmethod
    def from_environment(cls) -> Settings:
        text = os.environ.get(ENVIRONMENT)
        return cls() if not text else cls.from_json(text)


def speculative_config(
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    trie_path: str | None = None,
    save_every_s: float = 300.0,
    **config: Any,
) -> dict[str, Any]:
    """vLLM's `speculative_config` for Lookahead; exports the drafter's settings for vLLM's worker processes.

    `num_speculative_tokens`: the longest chain a request is sent (the policy sends less
    where that pays); `config`: LookaheadConfig fields (e.g. trie_max_nodes=200_000).
    """
    if not (isinstance(num_speculative_tokens, int) and num_speculative_tokens >= 1):
        raise ValueError(f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}")
    path = None if trie_path is None else os.path.abspath(trie_path)  # vLLM's workers may start elsewhere
    settings = Settings(LookaheadConfig(**config), path, save_every_s)
    os.environ[ENVIRONMENT] = settings.to_json()
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": num_speculative_tokens}


__all__ = ["ENVIRONMENT", "PROPOSER", "Settings", "speculative_config"]
