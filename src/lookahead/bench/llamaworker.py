"""llama-cpp-python's plain greedy decoding, in this process or in another interpreter's (another build of llama.cpp).

`make` builds llama.cpp without llamafile's matrix kernels, because they sum a pass of several
tokens in another order than the one-token step (README: the llama.cpp backend). A user who
installs llama-cpp-python as it comes gets them, and with them faster prompt reading: what a
GGUF user runs instead is that build's plain decoding. Both builds are the same Python module,
so the other one runs in an interpreter of its own — this file run as a script there (it needs
only the standard library and `llama_cpp`) — and answers prompts one JSON line at a time:

    python src/lookahead/bench/llamaworker.py MODEL.gguf --threads 2 --max-new-tokens 128 --end-ids 2,0
    stdin  {"ids": [1, 2, 3]}        stdout  {"tokens": [...]}

`llamabench --default-build PYTHON` drives it (`Worker`) beside the build it imports itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SETTINGS = {"n_ctx": 4096, "verbose": False}
"""What every `Llama` of the benchmark is opened with, besides its threads."""


def open_llama(path: str | Path, threads: int, **options: Any):
    """A `llama_cpp.Llama` of the file with the benchmark's settings (`options`: e.g. a draft model)."""
    import llama_cpp

    return llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, **SETTINGS, **options)


def greedy(llama, ids: list[int], end_ids: Iterable[int], max_new_tokens: int) -> list[int]:
    """`Llama.generate`'s greedy decoding of `ids` as a new request, up to an end id (llama-cpp-python keeps the cells
    of the prefix `ids` shares with its last prompt, as the engine does)."""
    ends, out = frozenset(end_ids), []
    for token in llama.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(token)
        if token in ends or len(out) == max_new_tokens:
            break
    return out


class Worker:
    """This file as a script under `python` (an interpreter with another build of llama-cpp-python), one request at
    a time; the process ends with `close()`."""

    def __init__(self, python: str, path: str | Path, threads: int, end_ids: Iterable[int], max_new_tokens: int):
        # -I: this file's folder (which holds modules named like common ones) is not put on the other path
        command = [python, "-I", __file__, str(path), "--threads", str(threads), "--max-new-tokens",
                   str(max_new_tokens), "--end-ids", ",".join(map(str, sorted(end_ids)))]  # fmt: skip
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.build = self._read()["build"]
        """`llama_cpp.llama_print_system_info()` of the worker's build (its kernels: LLAMAFILE = 1 or not)."""

    def generate(self, ids: list[int]) -> list[int]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"ids": ids}) + "\n")
        self.process.stdin.flush()
        return self._read()["tokens"]

    def _read(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker ({self.process.args[0]}) ended: see its error above")
        return json.loads(line)

    def close(self) -> None:
        """End the worker (killed if it does not end within a minute of its input closing)."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .gguf file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--end-ids", default="", help="comma-separated token ids that end an answer")
    args = parser.parse_args(argv)
    import llama_cpp

    llama = open_llama(args.model, args.threads)
    end_ids = [int(token) for token in args.end_ids.split(",") if token]
    info = llama_cpp.llama_print_system_info()
    print(json.dumps({"build": info.decode() if isinstance(info, bytes) else str(info)}), flush=True)
    for line in sys.stdin:
        ids = json.loads(line)["ids"]
        print(json.dumps({"tokens": greedy(llama, ids, end_ids, args.max_new_tokens)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
