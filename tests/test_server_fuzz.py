"""The served OpenAPI document against the server: schemathesis draws requests from it, valid and
broken (boundary values first, then random ones), and checks that no answer is a 5xx and that each
answer's status, content type and body are ones the document declares.

A tiny random model behind the bundled model's real tokenizer keeps each generation quick (its
context is 128 tokens) while the HTTP layer, the checks and the tokenizer are the real ones.
schemathesis runs as its command line, its stable interface, against a server in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serving import running
from tiny_models import tiny_model

from lookahead import LookaheadEngine
from lookahead.server import ServerSettings, create_app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # slow: loads the bundled tokenizer

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
EXAMPLES = 15  # per operation and phase: about 230 requests, under a minute on two cores


def test_every_answer_is_one_the_document_declares(tokenizer, tmp_path):
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=128)
    with running(create_app(LookaheadEngine(model, tokenizer), ServerSettings("smollm2-135m"))) as url:
        command = [
            *(sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json"),
            *("--checks", CHECKS, "--max-examples", str(EXAMPLES), "--phases", "examples,coverage,fuzzing"),
            *("--workers", "1", "--request-timeout", "60", "--report", "json", "--report-dir", str(tmp_path)),
        ]
        run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache too
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    (report_file,) = tmp_path.glob("json-*.json")
    report = json.loads(report_file.read_text())
    operations = 7  # the page, health, metrics, the model list and card, the two generation routes
    assert report["operations"]["tested"] == report["operations"]["total"] == operations
    assert report["test_cases"]["generated"] >= operations * EXAMPLES
    for operation in ("POST /v1/completions", "POST /v1/chat/completions"):  # the fuzz reached generation
        assert sum(phase["accepted"] for phase in report["valid_rates"][operation].values()) > 0, operation
