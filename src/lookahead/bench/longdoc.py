"""Long documents: lookahead against plain decoding on documentation questions of 0.5k to 8k tokens.

For every prompt length, questions on documentation (bench/longdocs.py) are answered by
lookahead and by plain greedy decoding, in alternating order, twice: on a fresh engine (an
empty trie and rates: the first request a service sees) and on one warm engine that has
answered questions on other documents first. Reported per length and phase: speedup
(plain seconds / lookahead seconds, whole request with prefill), tokens per step, time to
first token of both, whether the outputs are identical; then time to first token alone at
one length, many times over, each run on a fresh engine (the only work lookahead adds
before the first token is indexing the prompt); and, without the model, what indexing a
prompt costs per token (time and retained bytes) up to 32k tokens.

    python -m lookahead.bench.longdoc --out benchmarks/longdoc-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..drafting.trie import TokenTrie
from ..engine import LookaheadEngine
from ..models import load_model
from .datasets import doc_prompts
from .longdocs import doc_question, documentation
from .report import add_model_options, markdown_table, run_record

LENGTHS = (512, 1024, 2048, 4096, 8192)
INDEX_LENGTHS = (1024, 4096, 32768)
WARMUP_QUESTIONS = 4
"""Questions a warm engine answers (512-token documents, not the measured ones) before measuring."""
COLUMNS = ["length", "phase", "prompts", "speedup", "decode_speedup", "tokens_per_step", "draft_per_step",
           "ttft_lookahead_s", "ttft_plain_s", "exact_match"]  # fmt: skip
INDEX_COLUMNS = ["tokens", "index_us_per_token", "index_bytes_per_token"]
FIRST_TOKEN_COLUMNS = ["prompt_tokens", "runs", "ttft_lookahead_s", "ttft_plain_s", "pair_difference_pct",
                       "pair_range_pct", "outside_prefill_lookahead_ms", "outside_prefill_plain_ms"]  # fmt: skip


def timed(engine: LookaheadEngine, ids: list[int], new_tokens: int, lookahead: bool) -> dict:
    """One request: its output ids, seconds, time to first token, steps and draft nodes sent."""
    first: list[float] = []
    clock = time.perf_counter()
    out = engine.generate(ids, new_tokens, lookahead, on_tokens=lambda _: first or first.append(time.perf_counter()))
    seconds = time.perf_counter() - clock
    stats = out.stats
    return {"ids": out.token_ids, "seconds": seconds, "ttft": first[0] - clock, "prefill": stats.prefill_s,
            "steps": stats.steps, "tokens": stats.new_tokens, "draft": stats.draft_tokens}  # fmt: skip


def compare(engine: LookaheadEngine, ids: list[int], new_tokens: int, lookahead_first: bool) -> dict:
    """Lookahead and plain on one prompt through `engine`, in the order given; their figures side by side."""
    runs = {}
    for lookahead in (lookahead_first, not lookahead_first):
        runs[lookahead] = timed(engine, ids, new_tokens, lookahead)
    fast, plain = runs[True], runs[False]
    return {"prompt_tokens": len(ids), "lookahead_s": fast["seconds"], "plain_s": plain["seconds"],
            "ttft_lookahead_s": fast["ttft"], "ttft_plain_s": plain["ttft"], "steps": fast["steps"],
            "tokens": fast["tokens"], "draft": fast["draft"], "exact": fast["ids"] == plain["ids"]}  # fmt: skip


def summarize(rows: list[dict]) -> list[dict]:
    """Per length and phase: total plain time over total lookahead time, tokens per step, median TTFTs.

    `decode_speedup` is the same ratio after the first token: a long prefill is the same code for
    both methods, yet on a shared machine it swings by 10-20 % between two runs, which at 8k
    tokens is most of a request.
    """
    out = []
    for key in dict.fromkeys((r["length"], r["phase"]) for r in rows):
        group = [r for r in rows if (r["length"], r["phase"]) == key]
        steps = sum(r["steps"] for r in group)
        out.append({
            "length": key[0],
            "phase": key[1],
            "prompts": len(group),
            "speedup": round(sum(r["plain_s"] for r in group) / sum(r["lookahead_s"] for r in group), 3),
            "decode_speedup": round(_after_first(group, "plain") / _after_first(group, "lookahead"), 3),
            "tokens_per_step": round(sum(r["tokens"] for r in group) / steps, 2),
            "draft_per_step": round(sum(r["draft"] for r in group) / steps, 2),
            "ttft_lookahead_s": round(statistics.median(r["ttft_lookahead_s"] for r in group), 3),
            "ttft_plain_s": round(statistics.median(r["ttft_plain_s"] for r in group), 3),
            "exact_match": round(sum(r["exact"] for r in group) / len(group), 3),
        })  # fmt: skip
    return out


def _after_first(group: list[dict], method: str) -> float:
    return sum(r[f"{method}_s"] - r[f"ttft_{method}_s"] for r in group)


def first_token(model, tokenizer, ids: list[int], runs: int) -> dict:
    """Time to first token of `ids`, lookahead and plain alternating `runs` times each, every run on a fresh engine.

    Medians of each, and how much longer lookahead took than plain in the same pair (%): the median
    and range over the pairs. A pair runs back to back, so a machine that drifts between pairs
    (a shared one does, by several percent at a long prefill) moves both of its runs. And, free of
    that noise, the median time to first token outside the prefill forward pass: the work each
    method does around the model (lookahead's is indexing the prompt and opening its drafter).
    """
    times: dict[bool, list[float]] = {True: [], False: []}
    outside: dict[bool, list[float]] = {True: [], False: []}
    for run in range(runs):
        for lookahead in (True, False) if run % 2 == 0 else (False, True):
            result = timed(LookaheadEngine(model, tokenizer), ids, 2, lookahead)
            times[lookahead].append(result["ttft"])
            outside[lookahead].append(result["ttft"] - result["prefill"])
    fast, plain = statistics.median(times[True]), statistics.median(times[False])
    pairs = [(a / b - 1) * 100 for a, b in zip(times[True], times[False], strict=True)]
    return {"prompt_tokens": len(ids), "runs": runs, "ttft_lookahead_s": round(fast, 3),
            "ttft_plain_s": round(plain, 3), "pair_difference_pct": round(statistics.median(pairs), 2),
            "pair_range_pct": f"{min(pairs):+.1f} to {max(pairs):+.1f}",
            "outside_prefill_lookahead_ms": round(statistics.median(outside[True]) * 1000, 2),
            "outside_prefill_plain_ms": round(statistics.median(outside[False]) * 1000, 2),
            "lookahead_s": times[True], "plain_s": times[False]}  # fmt: skip


def index_cost(prompt: list[int], repeats: int = 5) -> dict:
    """Median time per token of indexing `prompt` for a request, and the bytes the index keeps per token."""
    trie = TokenTrie()
    spent = []
    for i in range(repeats):
        clock = time.perf_counter()
        trie.insert(prompt, request=i)
        spent.append(time.perf_counter() - clock)
        kept = trie.stats()["prompt_bytes"]
        trie.finish(i)
    return {"tokens": len(prompt), "index_us_per_token": round(statistics.median(spent) / len(prompt) * 1e6, 3),
            "index_bytes_per_token": round(kept / len(prompt), 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths in tokens")
    parser.add_argument("--per-length", type=int, default=2, help="questions per length")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ttft-length", type=int, default=4096, help="prompt tokens of the time-to-first-token runs")
    parser.add_argument("--ttft-runs", type=int, default=7, help="time-to-first-token runs of each method (0: none)")
    parser.add_argument("--index-lengths", default=",".join(map(str, INDEX_LENGTHS)), help="prompt indexing, tokens")
    parser.add_argument("--out", default="bench-out/longdoc")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    engine = LookaheadEngine(model, tokenizer)
    context = engine.max_positions or 1 << 30

    def count(text: str) -> int:
        return len(engine.chat_ids([{"role": "user", "content": text}]))

    lengths = [min(int(n), context - args.max_new_tokens - 8) for n in args.lengths.split(",")]
    prompts = doc_prompts(count, lengths, args.per_length)
    ids = [engine.chat_ids([{"role": "user", "content": p.text}]) for p in prompts]
    engine.generate(ids[0], 4, use_lookahead=False)  # warm-up of the model's kernels, not measured
    rows = []
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True)):
        length = int(prompt.key.split("/")[1])
        row = compare(LookaheadEngine(model, tokenizer), prompt_ids, args.max_new_tokens, i % 2 == 0)
        rows.append({"length": length, "phase": "fresh engine", "key": prompt.key, **row})
        print(rows[-1], flush=True)
    warm = LookaheadEngine(model, tokenizer)
    for index in range(args.per_length, args.per_length + WARMUP_QUESTIONS):
        question = doc_question(count, 512, index)
        warm.generate(warm.chat_ids([{"role": "user", "content": question}]), args.max_new_tokens)
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True)):
        row = compare(warm, prompt_ids, args.max_new_tokens, i % 2 == 1)
        rows.append({"length": int(prompt.key.split("/")[1]), "phase": "warm engine", "key": prompt.key, **row})
        print(rows[-1], flush=True)
    firsts = []
    if args.ttft_runs > 0:
        (question,) = doc_prompts(count, [min(args.ttft_length, context - 8)], 1)
        question_ids = engine.chat_ids([{"role": "user", "content": question.text}])
        firsts.append(first_token(model, tokenizer, question_ids, args.ttft_runs))
        print(firsts[-1], flush=True)
    everything = tokenizer(documentation())["input_ids"]
    indexing = [index_cost(everything[:n]) for n in map(int, args.index_lengths.split(","))]
    summary = summarize(rows)
    result = {
        **run_record("lookahead.bench.longdoc", args, argv),
        "summary": summary,
        "first_token": firsts,
        "indexing": indexing,
        "results": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "longdoc.json").write_text(json.dumps(result, indent=1) + "\n")
    tables = "\n\n".join(
        [markdown_table(summary, COLUMNS)]
        + ([markdown_table(firsts, FIRST_TOKEN_COLUMNS)] if firsts else [])
        + [markdown_table(indexing, INDEX_COLUMNS)]
    )
    (out / "longdoc.md").write_text(tables + "\n")
    print(tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
