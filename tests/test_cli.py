"""The `lookahead` command as a user runs it: a real process, real output, real exit codes."""

import os
import re
import subprocess
import sys

import pytest


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lookahead.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--model", "no-such-model", "hi"],
        ["generate", "--model", "./nowhere/model.gguf", "hi"],
        ["generate", "--max-new-tokens", "0", "hi"],
        ["generate", "--dtype", "float8", "hi"],
        ["frobnicate"],
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(args):
    result = run(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(("lookahead: error:", "lookahead generate: error:"))


@pytest.mark.slow
def test_generate_compare_prints_the_first_time_and_the_asked_again_speedups():
    result = run("generate", "--compare", "--max-new-tokens", "32")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    first = next(line for line in lines if line.startswith("first time:"))
    again = next(line for line in lines if line.startswith("asked again:"))
    assert "speedup" in first and "tokens per forward pass" in first and "median of 3 rounds" in first
    assert "speedup" in again and "identical to plain: yes" in lines


@pytest.mark.slow
def test_show_drafts_prints_the_answer_a_legend_and_the_tokens_per_step():
    plain = run("generate", "--max-new-tokens", "24", "def add(a, b): return a + b")
    shown = run("generate", "--show-drafts", "--max-new-tokens", "24", "def add(a, b): return a + b")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == plain.stdout, "the same text, coloured only on a terminal"
    assert "drafted from: model prompt answers corpus recycled" in shown.stderr
    assert re.search(r"\d+ tokens in \d+ steps \([\d.]+ tokens per step\): model \d+", shown.stderr)


def test_config_sets_the_drafter_and_the_flags_go_over_it(capsys):
    from lookahead import LookaheadConfig
    from lookahead.cli import build_parser, engine_config, main

    args = build_parser().parse_args(
        ["generate", "--config", "policy=fixed,decoding_length=16", "--branch-length", "4"]
    )
    assert engine_config(args) == LookaheadConfig(policy="fixed", decoding_length=16, branch_length=4)
    assert engine_config(build_parser().parse_args(["serve"])) == LookaheadConfig()
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--config", "policy=sometimes"])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("lookahead serve: error: argument --config:") and "policy" in line
