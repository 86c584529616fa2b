"""`lookahead serve --replicas 2` on a real local Ray cluster: exact answers through Serve, shared tries,
a disconnect, the hub killed mid-run, SIGTERM saving one trie with both replicas' answers; and the
one-line errors of a bad set-up, before any model loads.

One Ray cluster for the whole module (started here, two CPUs: one per replica), one deployment
for every test that serves; the tests run in file order and build on each other's traffic.
The replicas draft with the fixed policy (every retrieved node is sent): whether the adaptive
policy drafts a learned answer depends on step timings and on the acceptance rates the
earlier traffic taught (traced: one split of the first four prompts between the replicas left
the other replica sending nothing, 39 steps for 40 tokens), and what is tested here is that
the answer reached the other replica's trie and is drafted from.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import hf_greedy

from lookahead import TokenTrie
from lookahead.cli import main

ray = pytest.importorskip("ray", reason="the ray extra is installed by make")

MODEL = "smollm2-135m"
TOKENS = 40
PROMPTS = [
    "Write a haiku about the sea.",
    "Name three uses of a paper clip.",
    "Explain what a hash table is in two sentences.",
    "Give a short recipe for pancakes.",
]


def _one_line_error(capsys, *args: str) -> str:
    """`lookahead ...` run in this process: it must exit 2 with one line of error, no traceback."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    return line


def test_bad_scale_out_set_ups_are_one_line_and_exit_2(capsys, monkeypatch):
    assert (
        _one_line_error(capsys, "serve", "--replicas", "0") == "lookahead: error: --replicas must be at least 1, got 0"
    )
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    unreachable = _one_line_error(capsys, "serve", "--replicas", "2", "--ray-address", f"127.0.0.1:{port}")
    assert unreachable.startswith(f"lookahead: error: --ray-address 127.0.0.1:{port}: no Ray cluster answers there")
    assert "expected HOST:PORT" in _one_line_error(capsys, "serve", "--ray-address", "nowhere")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    missing = _one_line_error(capsys, "serve", "--replicas", "2")
    assert (
        missing
        == "lookahead: error: --replicas needs Ray Serve, and ray is not installed: pip install 'lookahead[ray]'"
    )


def test_the_hub_handle_forwards_only_the_protocols_names():
    from lookahead.server.ray_replica import RayHub

    hub = RayHub(lambda: pytest.fail("no actor is looked up for a private or special name"))
    assert not hasattr(hub, "_missing") and not hasattr(hub, "__setstate__")
    assert copy.copy(hub).timeout_s == hub.timeout_s and callable(hub.since)


@pytest.fixture(scope="module")
def cluster():
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="lookahead")
    yield context.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory, request):
    """The command as an operator runs it, joining the module's cluster: (process, url, trie path, log)."""
    folder = tmp_path_factory.mktemp("replicas")
    trie_path, log = folder / "trie.bin", folder / "serve.log"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "lookahead.cli", "serve", "--replicas", "2", "--ray-address", cluster,
               "--port", str(port), "--trie-path", str(trie_path), "--drain-timeout", "5",
               "--config", "policy=fixed"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    request.getfixturevalue("references")  # the model's own answers, computed while the replicas start
    deadline = time.monotonic() + 400
    while True:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"the replicas did not come up:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    yield process, url, trie_path, log
    if process.poll() is None:
        process.kill()
        process.wait(30)


@pytest.fixture(scope="module")
def references(default_model):
    model, tokenizer = default_model
    chat = {p: [{"role": "user", "content": p}] for p in PROMPTS}
    ids = {
        p: list(tokenizer.apply_chat_template(chat[p], add_generation_prompt=True, return_dict=False)) for p in PROMPTS
    }
    return {p: (ids[p], hf_greedy(model, ids[p], TOKENS)) for p in PROMPTS}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(url: str, prompt: str) -> tuple[str, str]:
    """One greedy chat answer: (replica that served it, text)."""
    raw = _client(url).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0
    )
    return raw.headers["x-lookahead-replica"], raw.parse().choices[0].message.content


def _series(url: str, name: str, **labels: str) -> dict[str, float]:
    """Each replica's value of one series, from one /metrics read that lists both replicas.

    A replica lists the others from the hub; one whose hub call fails at that moment (a hub just
    restarted) lists only itself, so such a read is retried. A replica without the series counts 0.
    """
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        replicas = set(re.findall(r'replica="([^"]+)"', text))
        if len(replicas) == 2:
            break
        assert time.monotonic() < deadline, f"/metrics never listed both replicas: {sorted(replicas)}"
        time.sleep(0.5)
    values = dict.fromkeys(replicas, 0.0)
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match[1]))
            if {key: value for key, value in found.items() if key != "replica"} == labels:
                values[found["replica"]] = float(match[2])
    return values


def _until(check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


@pytest.mark.slow
def test_two_replicas_answer_exactly_and_name_themselves(served, references, tokenizer):
    _, url, _, _ = served
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _ask(url, p), PROMPTS))
    for prompt, (replica, text) in zip(PROMPTS, answers, strict=True):
        assert text == tokenizer.decode(references[prompt][1], skip_special_tokens=True)
        assert replica
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.headers["x-lookahead-replica"]
    _series(url, "lookahead_forward_steps_total")  # both post their metrics to the hub


@pytest.mark.slow
def test_the_page_and_its_source_stream_come_through_the_replicas(served, references, tokenizer):
    _, url, _, _ = served
    page = httpx.get(f"{url}/", timeout=30)
    assert page.status_code == 200 and 'id="answer"' in page.text and f'const MODEL = "{MODEL}";' in page.text
    prompt = PROMPTS[0]
    stream = _client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0, stream=True,
        extra_body={"lookahead_sources": True},
    )  # fmt: skip
    parts = [chunk.choices[0].model_extra["lookahead"] for chunk in stream if chunk.choices]
    text = "".join(piece["text"] for part in parts for piece in part["pieces"])
    assert text == tokenizer.decode(references[prompt][1], skip_special_tokens=True)


def _steps(url: str) -> dict[str, float]:
    """Each replica's forward steps once its posted metrics have caught up with what it served.

    A replica posts its metrics to the hub once a round (1 s), so a read just after an answer can
    show the count of before it, or of part of it; a count that holds over 2.5 s is a post made after.
    """
    last: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while True:
        steps = _series(url, "lookahead_forward_steps_total")
        if steps == last:
            return steps
        assert time.monotonic() < deadline, "the replicas' metrics never settled"
        last = steps
        time.sleep(2.5)


def _ask_until(url: str, prompt: str, wanted) -> str:
    """Ask `prompt` until a replica `wanted(name)` serves it (the router picks); that replica."""
    for _ in range(40):
        replica, _ = _ask(url, prompt)
        if wanted(replica):
            return replica
    raise AssertionError("the router never chose such a replica")


def _shared(url: str, kind: str) -> dict[str, float]:
    return _series(url, "lookahead_shared_answers", kind=kind)


@pytest.mark.slow
def test_an_answer_served_by_one_replica_is_drafted_from_on_the_other(served):
    _, url, _, _ = served
    published = _shared(url, "published")
    prompt = "Describe a lighthouse at night in a few sentences."
    before = _steps(url)
    first, _ = _ask(url, prompt)
    first_steps = _steps(url)[first] - before[first]
    (other,) = set(published) - {first}

    def learned() -> bool:
        """`first` has posted the answer's publication, and `other` has learned every answer `first` published.

        A rise of `other`'s applied count alone could be an earlier answer still on its way (CI once saw 37
        steps and then 39: the answer had not arrived).
        """
        now = _shared(url, "published")[first]
        return now > published[first] and _shared(url, "applied")[other] >= now

    _until(learned)
    before = _steps(url)
    _ask_until(url, prompt, lambda name: name == other)  # asks that `first` serves meanwhile count for it only
    second_steps = _steps(url)[other] - before[other]
    assert second_steps < 0.75 * first_steps, (first_steps, second_steps)  # the other drafts the answer it learned


@pytest.mark.slow
def test_a_client_leaving_mid_stream_frees_its_row(served, references, tokenizer):
    _, url, _, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to two hundred."}],
            "max_tokens": 400, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as stream:
        replica = stream.headers["x-lookahead-replica"]
        lines = (line for line in stream.iter_lines() if line)
        assert next(lines).startswith("data: {") and next(lines).startswith("data: {")
    cancelled = {"endpoint": "chat", "outcome": "cancelled"}
    _until(lambda: _series(url, "lookahead_generations_total", **cancelled).get(replica, 0.0) >= 1)
    prompt = PROMPTS[0]
    assert _ask(url, prompt)[1] == tokenizer.decode(references[prompt][1], skip_special_tokens=True)


def _hub():
    (found,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("::answer-hub")]
    return ray.get_actor(found["name"], namespace=found["namespace"])


@pytest.mark.slow
def test_serving_goes_on_when_the_hub_dies_and_sharing_resumes(served, references, tokenizer):
    _, url, _, _ = served
    old = _hub()
    epoch = ray.get(old.stats.remote())["epoch"]
    ray.kill(old)
    prompt = PROMPTS[1]
    assert _ask(url, prompt)[1] == tokenizer.decode(references[prompt][1], skip_special_tokens=True)

    def renewed() -> bool:
        try:
            return ray.get(_hub().stats.remote(), timeout=5)["epoch"] != epoch
        except (ValueError, ray.exceptions.RayError):
            return False

    _until(renewed, timeout_s=120)  # Serve's controller starts an empty hub
    applied = _shared(url, "applied")  # the new hub hears each replica's metrics a round after it starts
    first, _ = _ask(url, "Write two sentences about autumn leaves.")
    (other,) = set(applied) - {first}
    _until(lambda: _shared(url, "applied").get(other, 0.0) > applied[other], timeout_s=60)


@pytest.mark.slow
def test_sigterm_saves_one_trie_holding_both_replicas_answers(served, references):
    process, url, trie_path, log = served
    served_by: dict[str, list[int]] = {}
    for prompt in PROMPTS:
        replica, _ = _ask(url, prompt)
        served_by.setdefault(replica, references[prompt][1])
    for prompt in PROMPTS:  # the router may have sent them all to one replica
        if len(served_by) == 2:
            break
        replica = _ask_until(url, prompt, lambda name: name not in served_by)
        served_by[replica] = references[prompt][1]
    time.sleep(2)  # a sharing round
    process.send_signal(signal.SIGTERM)
    assert process.wait(120) == 0, log.read_text()
    trie = TokenTrie.load(trie_path)
    for answer in served_by.values():
        tree = trie.retrieve(answer[:8], budget=16, max_depth=8, match_length=8, branching=False)
        assert tree.tokens[:8] == answer[8:16]
    assert "trie saved to" in Path(log).read_text()
