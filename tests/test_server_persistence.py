"""`lookahead serve` as an operator runs it: the trie file across restarts and signals, failed saves,
and one-line errors for a bad set-up."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from lookahead import TokenTrie
from lookahead.server.persistence import TrieSaver, load_trie

MODEL = "smollm2-135m"


def filled_trie(tokens: int, seed: int = 0) -> TokenTrie:
    trie = TokenTrie(8)
    state = seed
    sequence = []
    for _ in range(tokens):
        state = (state * 1103515245 + 12345) % 2**31
        sequence.append(state % 5000)
    trie.insert(sequence)
    return trie


def test_failed_save_keeps_the_last_good_file(tmp_path):
    path = tmp_path / "trie.bin"
    results = []
    small = TrieSaver(filled_trie(200), path, 60, lambda: 0, results.append)
    assert small.save()
    good = len(TokenTrie.load(path))
    large = TrieSaver(filled_trie(20000, seed=1), path, 60, lambda: 0, results.append)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 1024, limits[1]))
    try:
        assert not large.save()  # the disk refuses the bigger file half-way
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert results == ["ok", "error"]
    assert len(TokenTrie.load(path)) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trie.bin"]  # no scratch file left behind
    assert large.save() and len(TokenTrie.load(path)) == len(large.trie)


def test_periodic_save_only_after_changes(tmp_path):
    path = tmp_path / "trie.bin"
    finished = [0]
    saver = TrieSaver(filled_trie(300), path, 0.05, lambda: finished[0])

    async def watch() -> tuple[bool, bool]:
        task = asyncio.create_task(saver.run())
        await asyncio.sleep(0.3)
        idle = path.exists()
        finished[0] += 1  # a request ended: the next tick saves
        for _ in range(100):
            await asyncio.sleep(0.05)
            if path.exists():
                break
        task.cancel()
        return idle, path.exists()

    assert asyncio.run(watch()) == (False, True)
    assert len(TokenTrie.load(path)) == len(saver.trie)


def test_load_trie_errors_name_the_problem(tmp_path):
    assert load_trie(None) is None
    assert load_trie(tmp_path / "first-start.bin") is None
    with pytest.raises(ValueError, match="does not exist"):
        load_trie(tmp_path / "no-such-dir" / "trie.bin")
    (tmp_path / "junk.bin").write_bytes(b"not a trie at all")
    with pytest.raises(ValueError, match="move the file away"):
        load_trie(tmp_path / "junk.bin")


def test_load_trie_refuses_hostile_files_naming_them(tmp_path):
    from dataclasses import replace

    from lookahead.drafting.triefile import read_trie, write_trie

    path = tmp_path / "trie.bin"
    filled_trie(50).save(path)
    columns, settings = read_trie(path)
    write_trie(path, columns, replace(settings, tokenizer_id=12345))
    with pytest.raises(
        ValueError, match=f"^{path}: .*tokenizer_id must be text or null, got 12345.*move the file away"
    ):
        load_trie(path)
    write_trie(path, columns, replace(settings, ngram_length=10**6))
    with pytest.raises(ValueError, match="ngram_length must be an integer from 2 to 256, got 1000000"):
        load_trie(path)
    with pytest.raises(ValueError, match=r"not a regular file.*move the file away"):
        load_trie(tmp_path)


_KILLED_SAVE = """
import os, signal, sys
from lookahead import TokenTrie
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # killed half-way through the save
trie = TokenTrie(8)
trie.insert(list(range(100)))
trie.save(sys.argv[1])
"""


def test_start_removes_what_a_killed_save_left(tmp_path):
    path = tmp_path / "trie.bin"
    killed = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path)], capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    (left,) = tmp_path.iterdir()
    assert left.name.startswith("trie.bin.") and left.name.endswith(".tmp")
    assert load_trie(path) is None and left.exists()  # too recent to be sure its writer is gone
    long_ago = time.time() - 3600
    os.utime(left, (long_ago, long_ago))
    assert load_trie(path) is None and not left.exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lookahead.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize("problem", ["missing directory", "unreadable file"])
def test_bad_trie_path_is_one_line_and_exit_2(tmp_path, problem):
    path = tmp_path / "nowhere" / "trie.bin"
    if problem == "unreadable file":
        path = tmp_path / "trie.bin"
        path.write_bytes(b"garbage")
    result = _cli("serve", "--trie-path", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("lookahead: error:")


def test_serve_without_the_server_packages_prints_an_install_hint():
    code = "import sys; sys.modules['fastapi'] = None; from lookahead.cli import main; sys.exit(main(['serve']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "lookahead: error: serve needs fastapi, which is not installed: pip install 'lookahead[serve]'"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(trie_path: Path, log: Path, *options: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "lookahead.cli",
        "serve",
        "--port",
        str(port),
        "--threads",
        "2",
        "--trie-path",
        str(trie_path),
        *options,
    ]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.mark.slow
def test_trie_saved_on_shutdown_and_loaded_on_restart(tmp_path):
    path, log = tmp_path / "trie.bin", tmp_path / "server.log"
    process, url = _start(path, log)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.completions.create(model=MODEL, prompt="def quicksort(items):", max_tokens=16, temperature=0)
        assert reply.usage.completion_tokens == 16
        learned = httpx.get(f"{url}/health").json()["trie_nodes"]
        assert learned > 0 and not path.exists()
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0  # saved first; a clean stop on SIGTERM is a success
    finally:
        process.kill()
    assert len(TokenTrie.load(path)) == learned

    process, url = _start(path, log)
    try:
        assert httpx.get(f"{url}/health").json()["trie_nodes"] == learned
        assert f"trie loaded from {path} ({learned} nodes)" in log.read_text()
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130
    finally:
        process.kill()
    assert len(TokenTrie.load(path)) == learned
    assert f"trie saved to {path} ({learned} nodes)" in log.read_text()


DRAIN_S = 2.0


@pytest.mark.slow
def test_sigterm_under_load_drains_saves_the_trie_and_exits_0(tmp_path):
    """SIGTERM while one stream runs and one request waits behind it (a batch of one): the waiting request
    and a new one get a JSON 503 at once, the stream goes on for the drain time, then ends with an error
    event and [DONE]; the trie is saved and the process exits 0 soon after."""
    path, log = tmp_path / "trie.bin", tmp_path / "server.log"
    process, url = _start(path, log, "--max-batch", "1", "--drain-timeout", str(DRAIN_S))
    short = {"model": MODEL, "prompt": "Hi", "max_tokens": 8}
    try:
        body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 4000, "temperature": 0}
        queued: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: queued.append(httpx.post(f"{url}/v1/completions", json=short, timeout=120))
        )
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as stream:
            events = (line for line in stream.iter_lines() if line)
            assert next(events).startswith("data: {")
            waiter.start()
            while httpx.get(f"{url}/health").json()["queue_length"] != 1:
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            waiter.join(30)
            (dropped,) = queued
            assert dropped.status_code == 503 and dropped.json()["error"]["code"] == "server_shutting_down"
            while httpx.get(f"{url}/health").status_code != 503:  # the drain has begun
                time.sleep(0.05)
            refused = httpx.post(f"{url}/v1/completions", json=short, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert int(refused.headers["retry-after"]) >= 1
            rest = list(events)
        streamed_s = time.monotonic() - signalled
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
        assert all(json.loads(line.removeprefix("data: "))["object"] == "text_completion" for line in rest[:-2])
        assert streamed_s >= DRAIN_S - 0.2, "the stream was cut before the drain time was over"
        assert process.wait(30) == 0
        assert time.monotonic() - signalled < DRAIN_S + 10
    finally:
        process.kill()
    saved = re.search(rf"trie saved to {re.escape(str(path))} \((\d+) nodes\)", log.read_text())
    assert saved and len(TokenTrie.load(path)) == int(saved.group(1)) > 0
