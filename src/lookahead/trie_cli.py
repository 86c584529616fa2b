"""`lookahead trie build | inspect`: warm a trie file from a corpus, and look inside one.

A corpus is JSON lines with a `text` field (one document a line) or plain text files (one
document a file). Its n-grams go in as shared n-grams, as if the model had written them, so
an engine started with `LookaheadEngine(..., trie=TokenTrie.load(path))` drafts from them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from .config import LookaheadConfig

_BLOCK = 1 << 18
"""Plain text is read and tokenized about this many characters at a time."""


def add_trie_parser(commands: argparse._SubParsersAction) -> None:
    trie = commands.add_parser("trie", help="build a trie file from a corpus, or inspect one")
    actions = trie.add_subparsers(dest="trie_command", required=True)
    build = actions.add_parser("build", help="insert a corpus (JSON lines with `text`, or text files) into a trie")
    build.add_argument("inputs", nargs="+", metavar="INPUT", help=".jsonl file with a `text` field, or a text file")
    build.add_argument("-o", "--output", required=True, help="trie file to write")
    build.add_argument("--model", default=None, help="model whose tokenizer to use (default: the bundled one)")
    build.add_argument("--max-nodes", type=int, default=LookaheadConfig.trie_max_nodes, help="node budget")
    build.add_argument("--into", default=None, help="add to this existing trie file instead of a new trie")
    inspect = actions.add_parser("inspect", help="size, sources and most frequent n-grams of a trie file")
    inspect.add_argument("file")
    inspect.add_argument("--model", default=None, help="model whose tokenizer decodes the n-grams")
    inspect.add_argument("--length", type=int, default=4, help="n-gram length of the most frequent list")
    inspect.add_argument("--top", type=int, default=10)


def run_trie(args: argparse.Namespace) -> int:
    return {"build": build, "inspect": inspect}[args.trie_command](args)


def documents(path: Path) -> Iterator[Iterator[str]]:
    """Each document of a corpus file, as pieces of text to tokenize one after another."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError) as err:
                    raise ValueError(f"{path}:{number}: not a JSON object with a `text` field") from err
                yield iter([text])
    else:
        yield _blocks(path)


def _blocks(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as text:
        while block := text.read(_BLOCK):
            yield block + text.readline()  # end on a line break, so no word is split


def build_trie(trie, tokenizer, paths: list[Path], progress=None) -> int:
    """Insert every document of `paths` into `trie` as corpus n-grams; returns tokens inserted."""
    inserted = 0
    for path in paths:
        for number, pieces in enumerate(documents(path)):
            key = ("corpus", str(path), number)
            for piece in pieces:
                ids = tokenizer.encode(piece, add_special_tokens=False)
                trie.observe(key, ids, source="corpus")
                inserted += len(ids)
                if progress:
                    progress(len(piece.encode("utf-8")))
            trie.finish(key)
    return inserted


def build(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from .drafting.trie import TokenTrie

    paths = [Path(p) for p in args.inputs]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
    output = Path(args.output)
    if output.is_dir() or not output.parent.is_dir():  # known before the model loads and the corpus is read
        raise ValueError(f"--output {output}: not a file name in an existing directory")
    trie = TokenTrie.load(args.into, max_nodes=args.max_nodes) if args.into else None  # before torch and the model
    from . import load_model
    from .decoding.transcript import eos_ids

    model, tokenizer = load_model(args.model)
    if trie is None:
        config = replace(LookaheadConfig(), trie_max_nodes=args.max_nodes)
        trie = TokenTrie.from_config(config, eos_ids(model.generation_config, tokenizer))
    trie.bind_tokenizer(tokenizer)
    columns = [BarColumn(), DownloadColumn(), TimeRemainingColumn()]
    with Progress("[progress.description]{task.description}", *columns, transient=True) as bar:
        task = bar.add_task("inserting", total=sum(p.stat().st_size for p in paths))
        tokens = build_trie(trie, tokenizer, paths, lambda n: bar.advance(task, n))
    try:
        trie.save(output)
    except OSError as err:
        raise ValueError(f"--output {output}: cannot write the trie file ({err.strerror or err})") from err
    stats = trie.stats()
    print(f"{args.output}: {tokens} tokens inserted, {stats['shared_nodes']} nodes, {stats['evicted_nodes']} evicted")
    return 0


def inspect(args: argparse.Namespace) -> int:
    from .drafting.trie import TokenTrie
    from .drafting.triefile import tokenizer_fingerprint

    trie = TokenTrie.load(args.file)  # a bad file is refused before torch and the model load
    stats = trie.stats()
    size = Path(args.file).stat().st_size
    print(f"file            {args.file} ({size / 1e6:.1f} MB)")
    print(f"nodes           {stats['shared_nodes']} (budget {stats['max_nodes']})")
    print(f"memory          {stats['bytes'] / 1e6:.1f} MB in use ({stats['bytes'] / max(len(trie), 1):.0f} B/node)")
    print(f"tokens learned  {stats['tokens_learned']}")
    print("sources         " + ", ".join(f"{name} {count}" for name, count in trie.sources().items()))
    print(f"settings        n-gram length {trie.ngram_length}, half-life {trie.half_life} tokens")
    table = trie.recycled
    kept = "none" if table is None else f"{stats['recycled_tokens']} tokens, their {table.k} likeliest next tokens"
    print(f"recycled        {kept}")
    print(f"model's choices {stats['model_choices']} tokens, each with the token the model last put after it")
    from . import load_model

    _, tokenizer = load_model(args.model)
    readable = trie.tokenizer_id in (None, tokenizer_fingerprint(tokenizer))
    heading = "decoded" if readable else "token ids: the file was built with another tokenizer"
    print(f"most frequent {args.length}-grams ({heading}):")
    for tokens, count in trie.most_frequent(args.length, args.top):
        shown = json.dumps(tokenizer.decode(tokens)) if readable else str(tokens)
        print(f"  {count:>9}  {shown}")
    return 0
