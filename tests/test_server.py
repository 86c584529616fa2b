"""The OpenAI-compatible server as clients see it: a real uvicorn server on 127.0.0.1, the official
`openai` client (and raw HTTP where the client would refuse to send), outputs compared exactly
with the engine's own output and with the model's `generate()`."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import hf_greedy
from prometheus_client.parser import text_string_to_metric_families
from serving import running

from lookahead import LookaheadEngine
from lookahead.server import ServerSettings, create_app

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TOKENS = 24
LONG_PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"  # the model keeps counting for hundreds of tokens


@pytest.fixture(scope="module")
def engine(default_model):
    return LookaheadEngine(*default_model)


@pytest.fixture(scope="module")
def url(engine):
    with running(create_app(engine, ServerSettings(MODEL))) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Poll until `condition()` holds; the deadline only keeps a broken server from hanging the run."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stream_text(chunks) -> tuple[str, str | None, object]:
    """Joined text, finish reason and usage of a streamed completion or chat completion."""
    text, finish, usage = [], None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.text if chunk.object == "text_completion" else choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


# ---- answers ----------------------------------------------------------------------------


def test_models_health_and_metrics(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    for name in (
        "lookahead_queue_length",
        "lookahead_trie_nodes",
        "lookahead_request_latency_seconds",
        "lookahead_tokens_per_step",
        "lookahead_forward_steps_total",
        "process_resident_memory_bytes",
    ):
        assert name in response.text


def test_openapi_document_declares_what_the_server_sends(url):
    document = httpx.get(f"{url}/openapi.json").json()
    assert "422" not in json.dumps(document["paths"]) and "HTTPValidationError" not in document["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "500", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(document["paths"]["/health"]["get"]["responses"]) == {"200", "500", "503"}
    assert document["components"]["schemas"]["ChatRequest"]["properties"]["model"]["enum"] == [MODEL]


def test_completion_equals_engine_and_model_generate(client, engine, default_model):
    model, tokenizer = default_model
    prompt = "def fibonacci(n):"
    ids = engine.encode(prompt)
    expected = engine.generate(prompt, TOKENS)
    assert expected.text == tokenizer.decode(hf_greedy(model, ids, TOKENS), skip_special_tokens=True)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0)
    assert reply.object == "text_completion" and reply.model == MODEL
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    assert reply.usage.total_tokens == len(ids) + len(expected.token_ids)


def test_chat_equals_engine_and_model_generate(client, engine, default_model):
    model, tokenizer = default_model
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three prime numbers."},
    ]
    ids = engine.chat_ids(messages)
    expected = engine.chat(messages, 32)
    assert expected.text == tokenizer.decode(hf_greedy(model, ids, 32), skip_special_tokens=True)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(expected.token_ids))


def test_a_long_document_is_served_and_one_past_the_context_is_refused(client, engine):
    from lookahead.bench.longdocs import doc_question

    def count(text: str) -> int:
        return len(engine.chat_ids([{"role": "user", "content": text}]))

    messages = [{"role": "user", "content": doc_question(count, 2000)}]
    expected = engine.chat(messages, 16)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(engine.chat_ids(messages)) > 1500
    too_long = [{"role": "user", "content": messages[0]["content"] * 5}]  # about 10k tokens, past 8,192
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL, messages=too_long, max_tokens=16)


def test_stream_equals_non_stream_equals_engine(client, engine):
    prompt = "Write a Python function that reverses a string."
    messages = [{"role": "user", "content": prompt}]
    expected_chat, expected_text = engine.chat(messages, TOKENS), engine.generate(prompt, TOKENS)
    common = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0}
    chat = client.chat.completions.create(messages=messages, **common)
    chat_stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **common
    )
    completion = client.completions.create(prompt=prompt, **common)
    completion_stream = client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True}, **common
    )
    for whole, streamed, expected in (
        (chat, chat_stream, expected_chat),
        (completion, completion_stream, expected_text),
    ):
        text, finish, usage = stream_text(streamed)
        body = whole.choices[0]
        assert text == (body.message.content if whole.object == "chat.completion" else body.text) == expected.text
        assert finish == body.finish_reason == expected.finish_reason
        assert usage.model_dump() == whole.usage.model_dump()


def test_stream_wire_format(url):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    ids = {json.loads(line[6:])["id"] for line in events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")


def test_prompt_as_token_ids(client, engine):
    ids = engine.encode("The capital of France is")
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text == engine.generate(ids, 12).text


def test_eight_concurrent_clients_get_exact_outputs(url, engine):
    questions = [
        "What is a list in Python?",
        "Give me a haiku about rain.",
        "What is 17 times 3?",
        "Explain recursion in one sentence.",
    ]
    expected = {q: engine.chat([{"role": "user", "content": q}], TOKENS).text for q in questions}

    def ask(i: int) -> tuple[str, str]:
        question = questions[i % len(questions)]
        own = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        call = {
            "model": MODEL,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": TOKENS,
            "temperature": 0,
        }
        if i % 2:
            return question, stream_text(own.chat.completions.create(stream=True, **call))[0]
        return question, own.chat.completions.create(**call).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert [text for _, text in answers] == [expected[q] for q, _ in answers]


def test_clients_leaving_mid_stream_leave_the_batch_and_the_others_stay_exact(url, engine):
    """Six streams run together; two hang up after a few chunks; the four others end exactly as alone."""
    questions = ["Name three colours.", "What is an integer?", "Say hello in French.", "What is a tuple?"]
    expected = {q: engine.chat([{"role": "user", "content": q}], TOKENS).text for q in questions}
    cancelled = metric(url, "lookahead_generations_total", endpoint="completions", outcome="cancelled")
    seen_batch = []

    def leaver() -> None:
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            for _ in range(4):
                assert next(line for line in lines if line.startswith("data: "))
            seen_batch.append(metric(url, "lookahead_batch_size"))

    def ask(question: str) -> str:
        own = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        call = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": TOKENS,
                "temperature": 0}  # fmt: skip
        return stream_text(own.chat.completions.create(stream=True, **call))[0]

    with ThreadPoolExecutor(6) as pool:
        leaving = [pool.submit(leaver) for _ in range(2)]
        answers = list(pool.map(ask, questions))
        for future in leaving:
            future.result()
    assert answers == [expected[q] for q in questions]
    assert max(seen_batch) >= 2, "the streams must have shared the batch"
    wait_for(lambda: metric(url, "lookahead_batch_size") == 0, "the batch to empty")
    assert metric(url, "lookahead_generations_total", endpoint="completions", outcome="cancelled") == cancelled + 2


def test_n_choices_are_rows_of_one_prompt(client, engine):
    prompt = "Once upon a time"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=2)
    want = engine.generate(prompt, 12).text
    assert [c.index for c in greedy.choices] == [0, 1] and [c.text for c in greedy.choices] == [want, want]
    assert greedy.usage.completion_tokens == 2 * len(engine.generate(prompt, 12).token_ids)
    call = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.9, "seed": 5, "n": 2}
    sampled = client.completions.create(**call)
    seeded = [engine.generate(prompt, 12, do_sample=True, temperature=0.9, seed=s).text for s in (5, 6)]
    assert [c.text for c in sampled.choices] == seeded
    by_index: dict[int, list[str]] = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **call):
        for choice in chunk.choices:
            by_index[choice.index].append(choice.text)
    assert ["".join(by_index[0]), "".join(by_index[1])] == seeded


def test_the_seeds_of_n_choices_wrap_at_2_to_the_64(client, engine):
    call = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9}
    sampled = client.completions.create(**call, seed=2**64 - 1, n=2)
    seeded = [engine.generate(call["prompt"], 12, do_sample=True, temperature=0.9, seed=s).text for s in (2**64 - 1, 0)]
    assert [c.text for c in sampled.choices] == seeded


def test_chat_logprobs_are_the_engines_whole_and_streamed(client, engine):
    messages = [{"role": "user", "content": "List three primary colours, one per line."}]
    want = engine.generate(engine.chat_ids(messages), TOKENS, logprobs=3)
    call = {"model": MODEL, "messages": messages, "max_tokens": TOKENS, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}  # fmt: skip
    whole = client.chat.completions.create(**call).choices[0].logprobs.content
    assert [entry.token for entry in whole] == [engine.tokenizer.decode([r.token]) for r in want.logprobs]
    assert [entry.logprob for entry in whole] == pytest.approx([r.logprob for r in want.logprobs], abs=1e-4)
    assert [[alt.token for alt in entry.top_logprobs] for entry in whole] == [
        [engine.tokenizer.decode([token]) for token, _ in r.top] for r in want.logprobs
    ]
    assert all(entry.bytes == list(entry.token.encode()) for entry in whole)
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **call)
                for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    plain = client.chat.completions.create(**{**call, "logprobs": False, "top_logprobs": None}).choices[0]
    assert plain.logprobs is None and plain.message.content == engine.tokenizer.decode(
        want.token_ids, skip_special_tokens=True
    )


def test_completion_logprobs_have_tokens_offsets_and_alternatives(client, engine):
    prompt = "def add(a, b):"
    want = engine.generate(prompt, TOKENS, do_sample=True, temperature=0.7, seed=-3, logprobs=2)
    call = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.7, "seed": -3, "logprobs": 2}
    choice = client.completions.create(**call).choices[0]
    assert choice.text == want.text
    logprobs = choice.logprobs
    assert logprobs.tokens == [engine.tokenizer.decode([r.token]) for r in want.logprobs]
    assert logprobs.token_logprobs == pytest.approx([r.logprob for r in want.logprobs], abs=1e-4)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    streamed = [chunk.choices[0].logprobs for chunk in client.completions.create(stream=True, **call)
                if chunk.choices and chunk.choices[0].logprobs]  # fmt: skip
    assert [token for part in streamed for token in part.tokens] == logprobs.tokens
    assert [offset for part in streamed for offset in part.text_offset] == logprobs.text_offset


def test_sources_come_only_to_a_client_that_asks(client, engine, url):
    call = {"model": MODEL, "messages": [{"role": "user", "content": "Say: one two three one two three"}],
            "max_tokens": TOKENS, "temperature": 0, "stream": True}  # fmt: skip
    plain = [chunk.choices[0].model_extra for chunk in client.chat.completions.create(**call) if chunk.choices]
    assert all("lookahead" not in extra for extra in plain)
    chunks = [c.choices[0] for c in client.chat.completions.create(**call, extra_body={"lookahead_sources": True})
              if c.choices]  # fmt: skip
    parts = [choice.model_extra["lookahead"] for choice in chunks]
    text = "".join(choice.delta.content or "" for choice in chunks)
    assert "".join(piece["text"] for part in parts for piece in part["pieces"]) == text
    assert {piece["source"] for part in parts for piece in part["pieces"]} <= {"model", "prompt", "answers", "corpus",
                                                                              "recycled"}  # fmt: skip
    assert sum(part["tokens"] for part in parts) == len(engine.chat(call["messages"], TOKENS).token_ids)
    assert parts[-1]["steps"] >= 1
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert f'const MODEL = "{MODEL}";' in page.text


def test_penalties_and_logit_bias_are_the_engines(client, engine):
    prompt = "Write a list of fruits:"
    bias = {str(engine.encode(" apple")[0]): -100.0}
    want = engine.generate(prompt, TOKENS, presence_penalty=0.8, frequency_penalty=0.5,
                           logit_bias={int(k): v for k, v in bias.items()})  # fmt: skip
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                    presence_penalty=0.8, frequency_penalty=0.5, logit_bias=bias)  # fmt: skip
    assert got.choices[0].text == want.text != engine.generate(prompt, TOKENS).text


def test_stream_options_without_stream_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream_options={"include_usage": True})
    assert refused.value.body["param"] == "stream_options"


def test_sampling_with_a_seed_matches_the_engine(client, engine):
    prompt = "Once upon a time"
    settings = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    expected = engine.generate(prompt, TOKENS, do_sample=True, **settings)
    call = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, **settings}
    whole = client.completions.create(**call)
    streamed, _, _ = stream_text(client.completions.create(stream=True, **call))
    assert whole.choices[0].text == streamed == expected.text


def test_stop_sequences_match_the_engine(client, engine):
    prompt = "def fibonacci(n):"
    expected = engine.generate(prompt, TOKENS, stop=["return"])
    assert expected.finish_reason == "stop" and "return" not in expected.text
    call = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stop": "return"}
    whole = client.completions.create(**call)
    streamed, finish, _ = stream_text(client.completions.create(stream=True, **call))
    assert whole.choices[0].text == streamed == expected.text
    assert whole.choices[0].finish_reason == finish == "stop"


def test_unknown_fields_are_ignored(url):
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 2,
        "temperature": 0,
        "user": "u1",
        "metadata": {"a": "b"},
        "some_future_option": [1, 2],
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_metrics_count_tokens_steps_and_requests(client, url):
    tokens = metric(url, "lookahead_generated_tokens_total")
    steps = metric(url, "lookahead_forward_steps_total")
    served = metric(url, "lookahead_http_requests_total", route="/v1/completions", status="200")
    latencies = metric(url, "lookahead_request_latency_seconds_count", endpoint="completions")
    reply = client.completions.create(model=MODEL, prompt="import numpy as np\n", max_tokens=16, temperature=0)
    assert metric(url, "lookahead_generated_tokens_total") == tokens + reply.usage.completion_tokens
    assert steps < metric(url, "lookahead_forward_steps_total") <= steps + reply.usage.completion_tokens
    assert metric(url, "lookahead_http_requests_total", route="/v1/completions", status="200") == served + 1
    assert metric(url, "lookahead_request_latency_seconds_count", endpoint="completions") == latencies + 1
    assert metric(url, "lookahead_trie_nodes") > 0
    assert metric(url, "lookahead_queue_length") == 0


# ---- clients that leave, a full queue ------------------------------------------------------


@pytest.fixture(scope="module")
def one_at_a_time(engine):
    """A server of batches of one: requests queue behind the running one."""
    with running(create_app(engine, ServerSettings(MODEL, max_batch=1))) as base:
        yield base


def test_client_leaving_mid_stream_frees_the_model(one_at_a_time, engine):
    """A leaves after a few chunks of a 4000-token answer; B, queued behind it, is then served at once."""
    url = one_at_a_time
    cancelled = metric(url, "lookahead_generations_total", endpoint="completions", outcome="cancelled")
    expected = engine.generate("The sky is", 8).text
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
    answers = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line.startswith("data: "))
        waiter = threading.Thread(
            target=lambda: answers.append(
                openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
                .completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
                .choices[0]
                .text
            )
        )
        waiter.start()
        wait_for(lambda: httpx.get(f"{url}/health").json()["queue_length"] == 1, "B to queue")
    waiter.join(90)  # had A run on, B would time out (A needs minutes) and the assertion below fails
    assert answers == [expected]
    assert metric(url, "lookahead_generations_total", endpoint="completions", outcome="cancelled") == cancelled + 1


def test_bad_input_is_refused_at_once_while_the_batch_is_busy(one_at_a_time):
    """Checked before queueing: with the one place taken for minutes, a queued request would time out."""
    url = one_at_a_time
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
    bad = {
        "seed": {**GOOD_COMPLETION, "temperature": 1, "seed": 2**64},
        "prompt": _escaped({**GOOD_COMPLETION, "prompt": "\ud800"}),
        "stop[0]": _escaped({**GOOD_COMPLETION, "stop": ["\udbff"]}),
        "stream_options": {**GOOD_COMPLETION, "stream_options": {}},
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as running_stream:
        lines = running_stream.iter_lines()
        assert next(lines).startswith("data: ")
        for param, request in bad.items():
            sent = {"content": request} if isinstance(request, bytes) else {"json": request}
            headers = {"content-type": "application/json"}
            response = httpx.post(f"{url}/v1/completions", headers=headers, timeout=10, **sent)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert httpx.get(f"{url}/health").json()["busy"]  # the stream still holds the batch


def test_full_queue_answers_503_and_a_queued_client_that_leaves_frees_its_place(engine):
    with running(create_app(engine, ServerSettings(MODEL, max_queue=1, max_batch=1))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as running_stream:
            lines = running_stream.iter_lines()  # kept: dropping the iterator would close the connection
            assert next(lines).startswith("data: ")
            gave_up = []

            def impatient() -> None:  # waits 5 s for its first byte, then hangs up while still queued
                try:
                    httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 8}, timeout=5)
                except httpx.TimeoutException:
                    gave_up.append(True)

            leaver = threading.Thread(target=impatient)
            leaver.start()
            wait_for(lambda: httpx.get(f"{url}/health").json()["queue_length"] == 1, "the second request to queue")
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
            assert refused.value.status_code == 503
            assert int(refused.value.response.headers["retry-after"]) >= 1
            assert refused.value.response.json()["error"]["code"] == "queue_full"
            leaver.join(60)
            assert gave_up == [True]
            wait_for(lambda: httpx.get(f"{url}/health").json()["queue_length"] == 0, "the place to be freed")
            assert metric(url, "lookahead_generations_total", endpoint="completions", outcome="cancelled") == 1
            # the client that left is counted as 499 (client closed request), apart from the full queue's 503
            requests = {"route": "/v1/completions"}
            wait_for(lambda: metric(url, "lookahead_http_requests_total", **requests, status="499") == 1, "the 499")
            assert metric(url, "lookahead_http_requests_total", **requests, status="503") == 1
            assert httpx.get(f"{url}/health").json()["busy"]  # the first stream still runs
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
        assert reply.choices[0].text == engine.generate("Hi", 4).text


# ---- bad requests -------------------------------------------------------------------------


def _escaped(body: dict) -> bytes:
    """JSON with non-ASCII text escaped: the only way to send a lone surrogate (httpx refuses to encode one)."""
    return json.dumps(body).encode()


GOOD_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}

BAD_REQUESTS = {
    "malformed JSON": ("/v1/completions", b'{"model": "smollm2-135m", "prompt": ', 400, None),
    "body is not an object": ("/v1/completions", [1, 2, 3], 400, None),
    "empty body": ("/v1/completions", b"", 400, None),
    "missing model": ("/v1/completions", {"prompt": "Hello"}, 400, "model"),
    "unknown model": ("/v1/completions", {**GOOD_COMPLETION, "model": "gpt-4"}, 404, "model"),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    "empty prompt": ("/v1/completions", {**GOOD_COMPLETION, "prompt": ""}, 400, "prompt"),
    "prompt of the wrong type": ("/v1/completions", {**GOOD_COMPLETION, "prompt": 42}, 400, "prompt"),
    "several prompts": ("/v1/completions", {**GOOD_COMPLETION, "prompt": ["a", "b"]}, 400, "prompt"),
    "token id outside the vocabulary": ("/v1/completions", {**GOOD_COMPLETION, "prompt": [1, 10**9]}, 400, "prompt"),
    "prompt longer than the context": ("/v1/completions", {**GOOD_COMPLETION, "prompt": [42] * 9000}, 400, "prompt"),
    "max_tokens below 1": ("/v1/completions", {**GOOD_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens as a string": ("/v1/completions", {**GOOD_COMPLETION, "max_tokens": "10"}, 400, "max_tokens"),
    "max_tokens over the context": ("/v1/completions", {**GOOD_COMPLETION, "max_tokens": 10**6}, 400, "max_tokens"),
    "n of 0": ("/v1/completions", {**GOOD_COMPLETION, "n": 0}, 400, "n"),
    "best_of above 1": ("/v1/completions", {**GOOD_COMPLETION, "best_of": 3}, 400, "best_of"),
    "echo": ("/v1/completions", {**GOOD_COMPLETION, "echo": True}, 400, "echo"),
    "temperature above 2": ("/v1/completions", {**GOOD_COMPLETION, "temperature": 3}, 400, "temperature"),
    "top_p of 0": ("/v1/completions", {**GOOD_COMPLETION, "top_p": 0}, 400, "top_p"),
    "seed as a float": ("/v1/completions", {**GOOD_COMPLETION, "seed": 1.5}, 400, "seed"),
    "five stop sequences": ("/v1/completions", {**GOOD_COMPLETION, "stop": list("abcde")}, 400, "stop"),
    "stop of the wrong type": ("/v1/completions", {**GOOD_COMPLETION, "stop": [7]}, 400, "stop[0]"),
    "stream as a string": ("/v1/completions", {**GOOD_COMPLETION, "stream": "yes"}, 400, "stream"),
    "presence penalty above 2": (
        "/v1/completions",
        {**GOOD_COMPLETION, "presence_penalty": 2.5},
        400,
        "presence_penalty",
    ),
    "frequency penalty as a string": (
        "/v1/completions",
        {**GOOD_COMPLETION, "frequency_penalty": "1"},
        400,
        "frequency_penalty",
    ),
    "logit bias of an unknown token": (
        "/v1/completions",
        {**GOOD_COMPLETION, "logit_bias": {"1000000": 1}},
        400,
        "logit_bias",
    ),
    "logit bias above 100": ("/v1/completions", {**GOOD_COMPLETION, "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    "logit bias keyed by a word": ("/v1/completions", {**GOOD_COMPLETION, "logit_bias": {"cat": 1}}, 400, "logit_bias"),
    "completion logprobs above 5": ("/v1/completions", {**GOOD_COMPLETION, "logprobs": 6}, 400, "logprobs"),
    "top_logprobs above 20": (
        "/v1/chat/completions",
        {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    "top_logprobs without logprobs": ("/v1/chat/completions", {**GOOD_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    "no messages": ("/v1/chat/completions", {**GOOD_CHAT, "messages": []}, 400, "messages"),
    "unknown role": (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    "image content": (
        "/v1/chat/completions",
        {
            **GOOD_CHAT,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        },
        400,
        "messages[0].content",
    ),
    "chat n larger than the batch": ("/v1/chat/completions", {**GOOD_CHAT, "n": 9}, 400, "n"),
    "tools": ("/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    "chat max tokens over the context": (
        "/v1/chat/completions",
        {**GOOD_CHAT, "max_completion_tokens": 10**5},
        400,
        "max_completion_tokens",
    ),
    "lone surrogate in the prompt": (
        "/v1/completions",
        _escaped({**GOOD_COMPLETION, "prompt": "a\ud800b"}),
        400,
        "prompt",
    ),
    "lone surrogate in a message": (
        "/v1/chat/completions",
        _escaped({**GOOD_CHAT, "messages": [{"role": "user", "content": "a\udfffb"}]}),
        400,
        "messages[0].content",
    ),
    "lone surrogate in a text part": (
        "/v1/chat/completions",
        _escaped({**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}),
        400,
        "messages[0].content",
    ),
    "lone surrogate in a stop string": (
        "/v1/completions",
        _escaped({**GOOD_COMPLETION, "stop": "\udc00"}),
        400,
        "stop[0]",
    ),
    "empty stop sequence": ("/v1/completions", {**GOOD_COMPLETION, "stop": ["x", ""]}, 400, "stop[1]"),
    "seed of 2**64": ("/v1/completions", {**GOOD_COMPLETION, "seed": 2**64}, 400, "seed"),
    "seed below -2**63": ("/v1/completions", {**GOOD_COMPLETION, "seed": -(2**63) - 1}, 400, "seed"),
    "stream_options without stream": (
        "/v1/completions",
        {**GOOD_COMPLETION, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    "unknown route": ("/v1/embeddings", GOOD_COMPLETION, 404, None),
    "body too large": ("/v1/completions", {**GOOD_COMPLETION, "prompt": "x" * (3 * 1024 * 1024)}, 413, None),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_gets_its_4xx_with_an_openai_error_body(url, case):
    path, body, status, param = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{url}{path}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and isinstance(error["message"], str)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["param"] == param
    assert "Traceback" not in response.text


def test_wrong_method_is_405_with_an_openai_error_body(url):
    response = httpx.get(f"{url}/v1/completions")
    assert response.status_code == 405
    assert response.json()["error"]["message"]


# ---- API key ------------------------------------------------------------------------------


def test_api_key_required_when_set(engine):
    with running(create_app(engine, ServerSettings(MODEL, api_key="s3cret"))) as url:
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        bare = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=120)
        reply = right.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
        assert reply.choices[0].text == engine.generate("Hi", 2).text


def test_no_api_key_needed_when_unset(url):
    response = httpx.post(
        f"{url}/v1/completions", json={**GOOD_COMPLETION, "max_tokens": 1, "temperature": 0}, timeout=120
    )
    assert response.status_code == 200
