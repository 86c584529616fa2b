"""Load check of `lookahead serve`: N streaming clients for a fixed time on loopback, every answer checked.

Starts the real server in a subprocess, then runs `--clients` threads with the official
`openai` client for `--duration` seconds (and at most `--max-requests` requests). Each request
is one of the recorded benchmark prompts (greedy outputs recorded once with plain decoding, in
benchmarks/replay/), half through /v1/chat/completions with the prompt text and half through
/v1/completions with the prompt's token ids, and its streamed text must equal the recording.
Prompts repeat during the run, as questions do in a service: repeats show what the shared trie
earns. Reports requests served, errors, tokens per second, latency percentiles and the
server's resident memory at start and end; writes loadcheck.json and loadcheck.md. With
`--replicas N` the server runs as N replicas on Ray Serve (sharing their answers): memory is
then per replica (their mean), and the requests each replica served are counted.

    python -m lookahead.bench.loadcheck --clients 4 --duration 120 --out benchmarks/server
    python -m lookahead.bench.loadcheck --clients 4 --duration 120 --replicas 2 --out benchmarks/server-2-replicas
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from ..models import load_model
from .datasets import load_prompts
from .replay import load_records
from .report import environment, markdown_table

RECORDING = Path("benchmarks/replay/smollm2-135m.jsonl")
MODEL = "smollm2-135m"


@dataclass
class Case:
    dataset: str
    key: str
    text: str
    prompt_ids: list[int]
    expected_text: str
    expected_tokens: int


@dataclass
class Served:
    case: str
    endpoint: str
    repeat: bool
    exact: bool
    tokens: int
    first_token_s: float
    latency_s: float
    replica: str


def load_cases(path: Path, per_set: int, max_tokens: int) -> tuple[list[Case], Case]:
    """`per_set` recorded prompts of each data set, with the text the server must stream back, and a
    spare one (the longest other prompt) to warm the server up with before memory is measured."""
    header, records = load_records(path)
    if max_tokens > header["max_new_tokens"]:
        raise ValueError(f"--max-tokens {max_tokens}: the recording has only {header['max_new_tokens']} tokens each")
    tokenizer = load_model(MODEL)[1]  # the server loads its own model; this process only decodes
    taken: dict[str, int] = {}
    chosen, spares = [], []
    for record in records:
        taken[record["dataset"]] = taken.get(record["dataset"], 0) + 1
        (chosen if taken[record["dataset"]] <= per_set else spares).append(record)
    texts = {(p.dataset, p.key): p.text for p in load_prompts(list(taken), per_set + 1)}
    spare = max(spares[:: per_set + 1] or chosen, key=lambda record: len(record["prompt_ids"]))

    def case(record: dict) -> Case:
        expected = record["output_ids"][:max_tokens]
        text = texts.get((record["dataset"], record["key"]), "")
        decoded = tokenizer.decode(expected, skip_special_tokens=True)
        return Case(record["dataset"], record["key"], text, record["prompt_ids"], decoded, len(expected))

    return [case(record) for record in chosen], case(spare)


def start_server(threads: int, max_queue: int, log: Path, replicas: int = 1) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "lookahead.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--max-queue",
        str(max_queue),
        "--replicas",
        str(replicas),
    ]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300 * replicas
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"the server did not start; its log:\n{log.read_text()[-2000:]}")


def server_metrics(url: str) -> dict[str, list[float]]:
    """The samples of /metrics labelled by nothing but their replica, by name: one value per replica."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if set(sample.labels) <= {"replica"}:
                values.setdefault(sample.name, []).append(sample.value)
    return values


def ask(client, case: Case, chat: bool, max_tokens: int) -> tuple[str, int, float, float, str]:
    """One streamed request: text, completion tokens, seconds to the first text, seconds in all, replica."""
    clock = time.perf_counter()
    common = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        raw = client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": case.text}], **common
        )
    else:
        raw = client.completions.with_raw_response.create(prompt=case.prompt_ids, **common)
    replica, chunks = raw.headers.get("x-lookahead-replica", "one"), raw.parse()
    pieces, tokens, first = [], 0, None
    for chunk in chunks:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            if piece:
                first = first if first is not None else time.perf_counter() - clock
                pieces.append(piece)
    return "".join(pieces), tokens, first or 0.0, time.perf_counter() - clock, replica


def run_clients(url: str, cases: list[Case], clients: int, duration: float, max_requests: int, max_tokens: int):
    """Threads asking in turn until the time or the request budget is spent; served and failed requests."""
    lock = threading.Lock()
    served: list[Served] = []
    errors: list[str] = []
    counter = [0]
    seen: set[int] = set()
    end = time.monotonic() + duration

    def client_loop() -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        while time.monotonic() < end:
            with lock:
                if counter[0] >= max_requests:
                    return
                number = counter[0]
                counter[0] += 1
                index = number % len(cases)
                repeat = index in seen
                seen.add(index)
            case, chat = cases[index], number % 2 == 0
            try:
                text, tokens, first, latency, replica = ask(client, case, chat, max_tokens)
            except Exception as err:  # every failure is counted, and the run goes on
                with lock:
                    errors.append(f"{type(err).__name__}: {err}")
                continue
            exact = text == case.expected_text and tokens == case.expected_tokens
            with lock:
                served.append(
                    Served(
                        f"{case.dataset}/{case.key}",
                        "chat" if chat else "completions",
                        repeat,
                        exact,
                        tokens,
                        first,
                        latency,
                        replica,
                    )
                )

    memory: list[float] = []
    done = threading.Event()

    def watch_memory() -> None:
        while not done.wait(5.0):
            memory.append(statistics.mean(server_metrics(url)["process_resident_memory_bytes"]) / 2**20)

    clock = time.perf_counter()
    workers = [threading.Thread(target=client_loop) for _ in range(clients)]
    watcher = threading.Thread(target=watch_memory)
    for thread in [*workers, watcher]:
        thread.start()
    for worker in workers:
        worker.join()
    done.set()
    watcher.join()
    return served, errors, time.perf_counter() - clock, memory


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (with few samples, p99 is the slowest request)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)] if ordered else 0.0


def summarize(served: list[Served], errors: list[str], wall_s: float, rss: dict, server: dict) -> dict:
    tokens = sum(s.tokens for s in served)
    latency = [s.latency_s for s in served]
    first = [s.first_token_s for s in served]
    steps = server["forward_steps_total"]

    def decode_rate(group: list[Served]) -> float | None:
        """Tokens per second after the first one: queueing and prefill left out, the trie's part kept."""
        spent = sum(s.latency_s - s.first_token_s for s in group)
        return round(sum(s.tokens - 1 for s in group) / spent, 2) if group and spent > 0 else None

    return {
        "requests": len(served),
        "errors": len(errors),
        "exact": sum(s.exact for s in served),
        "wall_s": round(wall_s, 1),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 2),
        "latency_p50_s": round(percentile(latency, 0.5), 2),
        "latency_p99_s": round(percentile(latency, 0.99), 2),
        "first_token_p50_s": round(percentile(first, 0.5), 2),
        "first_token_p99_s": round(percentile(first, 0.99), 2),
        "decode_tokens_per_s_first_time": decode_rate([s for s in served if not s.repeat]),
        "decode_tokens_per_s_repeat": decode_rate([s for s in served if s.repeat]),
        "tokens_per_step": round(server["generated_tokens_total"] / steps, 2) if steps else None,
        "trie_nodes": int(server["trie_nodes"]),
        "rss_start_mib": round(rss["start"] / 2**20, 1),
        "rss_end_mib": round(rss["end"] / 2**20, 1),
        "rss_growth_mib": round((rss["end"] - rss["start"]) / 2**20, 1),
        "rss_peak_mib": round(rss["peak"] / 2**20, 1),
        "requests_by_replica": sorted(Counter(s.replica for s in served).values(), reverse=True),
    }


def write(
    out: Path, command: str, settings: dict, summary: dict, served: list[Served], errors: list[str], memory: list[float]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    body = {
        "command": command,
        "settings": settings,
        "environment": environment(),
        "summary": summary,
        "rss_every_5s_mib": [round(m, 1) for m in memory],
        "requests": [asdict(s) for s in served],
        "errors": errors,
    }
    (out / "loadcheck.json").write_text(json.dumps(body, indent=1) + "\n")
    rows = [{"measure": key, "value": value} for key, value in summary.items()]
    env = body["environment"]
    text = [
        "# Server load check",
        "",
        f"Command: `{command}`",
        "",
        f"{settings['clients']} concurrent streaming clients for {settings['duration_s']} s, {settings['max_tokens']} "
        f"new tokens per request, greedy, {settings['prompts']} recorded prompts in turn (half chat, half "
        f"completions with token ids); {env['machine']}, Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, {settings['threads']} torch threads in the server "
        f"({settings['replicas']} replica(s); memory figures are per replica).",
        "",
        markdown_table(rows, ["measure", "value"]),
        "",
    ]
    (out / "loadcheck.md").write_text("\n".join(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lookahead.bench.loadcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds during which new requests start")
    parser.add_argument("--max-requests", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--per-set", type=int, default=2, help="recorded prompts per data set")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the server (in all its replicas)")
    parser.add_argument("--replicas", type=int, default=1, help="serve with this many replicas on Ray Serve")
    parser.add_argument("--recording", default=str(RECORDING))
    parser.add_argument("--out", default="benchmarks/server")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 64 or not 0 < args.duration <= 600 or args.max_requests < 1:
        parser.error("--clients must be 1..64, --duration 0..600 s and --max-requests at least 1")
    cases, spare = load_cases(Path(args.recording), args.per_set, args.max_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        threads = max(1, args.threads // args.replicas)
        process, url = start_server(threads, 2 * args.clients, Path(scratch) / "server.log", args.replicas)
        try:
            for _ in range(args.replicas):  # warm-up (the router picks the less busy replica)
                ask(openai.OpenAI(base_url=f"{url}/v1", api_key="unused"), spare, False, args.max_tokens)
            start = server_metrics(url)
            served, errors, wall_s, memory = run_clients(
                url, cases, args.clients, args.duration, args.max_requests, args.max_tokens
            )
            final = server_metrics(url)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    server = {
        name: sum(final[f"lookahead_{name}"]) - sum(start[f"lookahead_{name}"])
        for name in ("generated_tokens_total", "forward_steps_total")
    }
    server["trie_nodes"] = max(final["lookahead_trie_nodes"])
    resident = "process_resident_memory_bytes"
    rss = {
        "start": statistics.mean(start[resident]),
        "end": statistics.mean(final[resident]),
        "peak": max([statistics.mean(final[resident]), *(m * 2**20 for m in memory)]),
    }
    summary = summarize(served, errors, wall_s, rss, server)
    settings = {
        "clients": args.clients,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "prompts": len(cases),
        "threads": args.threads,
        "replicas": args.replicas,
        "max_requests": args.max_requests,
    }
    command = "python -m lookahead.bench.loadcheck " + shlex.join(argv if argv is not None else sys.argv[1:])
    write(Path(args.out), command.strip(), settings, summary, served, errors, memory)
    print(json.dumps(summary, indent=1))
    ok = summary["errors"] == 0 and summary["exact"] == summary["requests"] > 0
    print("load check passed" if ok else "load check FAILED: errors or inexact outputs", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
