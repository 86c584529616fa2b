"""The `lookahead` command. A user mistake is one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
from collections.abc import Callable, Sequence

from .trie_cli import add_trie_parser

DEMO_PROMPT = (
    "Rewrite this function with type hints and a docstring, keeping the logic identical:\n"
    "```python\n"
    "def merge_intervals(intervals):\n"
    "    intervals = sorted(intervals, key=lambda pair: pair[0])\n"
    "    merged = []\n"
    "    for start, end in intervals:\n"
    "        if merged and start <= merged[-1][1]:\n"
    "            merged[-1][1] = max(merged[-1][1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged\n"
    "```"
)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="bundled name, local directory, .gguf file or hub id")
    parser.add_argument(
        "--backend", default="transformers", choices=["transformers", "llama.cpp"],
        help="llama.cpp: run a GGUF file (or a bundled model) on llama.cpp as it is (needs lookahead[llama])",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"],
        help="transformers: default float32; llama.cpp: default the file's own type, else a converted copy",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=_positive, default=None, help="CPU threads (torch's, or llama.cpp's)")


def _lookahead_config(text: str):
    from .config import LookaheadConfig

    try:
        return LookaheadConfig.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=_lookahead_config, default=None, metavar="key=value,...",
        help="drafter settings (LookaheadConfig fields), e.g. policy=fixed,decoding_length=16",
    )  # fmt: skip


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; above 0 samples")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="same seed, same output (with or without lookahead)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookahead", description="Lossless lookahead decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text for one prompt")
    _add_model_options(generate)
    generate.add_argument("prompt", nargs="?", default=DEMO_PROMPT, help="prompt text (default: a built-in demo)")
    generate.add_argument("--max-new-tokens", type=_positive, default=128)
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.add_argument(
        "--compare", action="store_true",
        help="also run plain decoding: the speedup the first time this prompt is asked, and asked again",
    )  # fmt: skip
    generate.add_argument("--decoding-length", type=_positive, default=None, help="most draft nodes per step")
    generate.add_argument("--branch-length", type=_positive, default=None, help="deepest draft path")
    generate.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    generate.add_argument(
        "--show-drafts", action="store_true",
        help="colour each token by where its draft came from (this prompt, earlier answers, a corpus, the model)",
    )  # fmt: skip
    _add_config_option(generate)
    _add_sampling_options(generate)

    bench = commands.add_parser("bench", help="side-by-side benchmark on the data sets")
    _add_model_options(bench)
    bench.set_defaults(threads=2)
    bench.add_argument("--datasets", default="humaneval,gsm8k,mtbench,code-edit")
    bench.add_argument(
        "--methods", default=None,
        help="default: plain,hf-greedy,hf-prompt-lookup,lookahead (transformers), plain,lookahead (llama.cpp)",
    )  # fmt: skip
    bench.add_argument(
        "--config", action="append", default=[], metavar="NAME:key=value,...", help="extra lookahead variant"
    )
    bench.add_argument("--limit", type=int, default=30, help="prompts per data set")
    bench.add_argument("--max-new-tokens", type=_positive, default=128)
    bench.add_argument("--out", default="bench-out", help="directory for results.json, results.md and plots")
    bench.add_argument("--json", default=None, help="also write the results JSON here")
    _add_sampling_options(bench)

    replay = commands.add_parser("replay", help="record greedy outputs once, then evaluate drafters offline")
    _add_model_options(replay)
    replay.add_argument("recording", help="JSON-lines file of recorded greedy outputs")
    replay.add_argument("--record", action="store_true", help="run plain greedy now and write the recording")
    replay.add_argument("--datasets", default="humaneval,gsm8k,mtbench,code-edit")
    replay.add_argument("--limit", type=int, default=30, help="prompts per data set (recording)")
    replay.add_argument("--max-new-tokens", type=_positive, default=128)
    replay.add_argument(
        "--config", action="append", default=[], metavar="NAME:key=value,...", help="drafter setting to evaluate"
    )
    replay.add_argument("--sweep", action="store_true", help="also every fixed decoding_length x branch_length")
    replay.add_argument("--out", default=None, help="directory for replay.json, replay.md (and sweep.png)")

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server, one engine and one shared trie")
    _add_model_options(serve)
    _add_config_option(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--trie-path", default=None, help="load the trie from this file; save it there periodically")
    serve.add_argument("--save-every", type=float, default=10.0, help="minutes between trie saves")
    serve.add_argument("--api-key", default=os.environ.get("LOOKAHEAD_API_KEY"), help="require Authorization: Bearer")
    serve.add_argument("--max-queue", type=_positive, default=32, help="waiting requests before answering 503")
    serve.add_argument("--max-batch", type=_positive, default=8, help="generations decoded together")
    serve.add_argument(
        "--drain-timeout", type=float, default=5.0, help="seconds running requests may finish after SIGTERM/SIGINT"
    )
    serve.add_argument(
        "--replicas", type=int, default=1, help="copies of the server on Ray Serve, sharing their answers (needs [ray])"
    )
    serve.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (HOST:PORT) instead of starting a local one"
    )
    add_trie_parser(commands)
    return parser


def engine_config(args: argparse.Namespace):
    """The LookaheadConfig of `--config`, with `--decoding-length` and `--branch-length` over it where given."""
    from .config import LookaheadConfig

    overrides = {
        key: value for key in ("decoding_length", "branch_length") if (value := getattr(args, key, None)) is not None
    }
    return dataclasses.replace(getattr(args, "config", None) or LookaheadConfig(), **overrides)


def _engine(args: argparse.Namespace, trie=None):
    import torch

    from . import LookaheadEngine, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    config = engine_config(args)
    model, tokenizer = load_model(
        args.model, dtype=args.dtype, device=args.device, backend=args.backend, threads=args.threads
    )
    return LookaheadEngine(model, tokenizer, config, trie)


def prompt_ids(engine, prompt: str, raw: bool) -> list[int]:
    """Token ids of `prompt`, inside the chat template when the model has one and `raw` is off."""
    if raw or not engine.tokenizer.chat_template:
        return engine.encode(prompt)
    return engine.chat_ids([{"role": "user", "content": prompt}])


def cmd_generate(args: argparse.Namespace) -> int:
    from .decoding.sampling import request_options

    engine = _engine(args)
    ids = prompt_ids(engine, args.prompt, args.raw)
    seed = 0 if args.seed is None and args.compare else args.seed  # a comparison needs both runs to draw alike
    options = request_options(args.temperature, args.top_p, args.top_k, seed, args.stop)
    stream = engine.stream(ids, args.max_new_tokens, **options)  # checks the options before any work
    engine.generate(ids, max_new_tokens=2, use_lookahead=False)  # warm-up: first calls pay one-off costs
    clock = time.perf_counter()
    show = _show_drafts(engine, stream) if args.show_drafts else _print_text(stream)
    show()
    fast_s = time.perf_counter() - clock
    mode = f"{engine.draft_mode} drafts"
    if not args.compare:
        print(f"[{mode}, {fast_s:.2f} s]", file=sys.stderr)
        return 0
    from . import LookaheadEngine
    from .compare import compare

    def fresh():  # the same model with an empty trie: the prompt as if asked for the first time
        first_time = LookaheadEngine(engine.model, engine.tokenizer, engine.config)
        return first_time.generate(ids, args.max_new_tokens, **options)

    result = compare(
        stream.output,
        plain=lambda: engine.generate(ids, args.max_new_tokens, use_lookahead=False, **options),
        fresh=fresh,
        again=lambda: engine.generate(ids, args.max_new_tokens, **options),
    )
    print("\n".join(result.lines(mode)))
    return 0 if result.identical else 1


def _print_text(stream) -> Callable[[], None]:
    def show() -> None:
        for delta in stream:
            print(delta, end="", flush=True)
        print()

    return show


def _show_drafts(engine, stream) -> Callable[[], None]:
    """Each kept token in its source's colour, a legend first and the tokens per step last (on stderr)."""
    from rich.console import Console
    from rich.text import Text

    from .sourceview import COLOURS, SourceView

    out, err = Console(highlight=False), Console(stderr=True, highlight=False)
    view = SourceView(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True))

    def show() -> None:
        legend = Text("drafted from: ")
        for name, colour in COLOURS.items():
            legend.append(f"{name} ", style=colour)
        err.print(legend)
        for _ in itertools.chain(stream, [None]):  # then the tokens that made no text of their own
            for piece, name in view.add(stream.tokens[view.taken :], stream.sources[view.taken :]):
                out.print(Text(piece, style=COLOURS[name]), end="")
        for piece, name in view.flush():
            out.print(Text(piece, style=COLOURS[name]), end="")
        out.print()
        err.print(view.summary(stream.steps))

    return show


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.cli import run_bench

    return run_bench(args, sys.argv[1:])


def cmd_replay(args: argparse.Namespace) -> int:
    from .bench.cli import run_replay

    return run_replay(args)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .server.main import serve
    except ImportError as err:
        raise ValueError(f"serve needs {err.name}, which is not installed: pip install 'lookahead[serve]'") from err
    return serve(args, _engine)


def cmd_trie(args: argparse.Namespace) -> int:
    from .trie_cli import run_trie

    return run_trie(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "generate": cmd_generate,
        "bench": cmd_bench,
        "replay": cmd_replay,
        "serve": cmd_serve,
        "trie": cmd_trie,
    }
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError) as err:  # user mistakes: one line, exit 2
        print(f"lookahead: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
