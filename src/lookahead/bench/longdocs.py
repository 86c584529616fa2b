"""Long-document questions: retrieved documentation and a question about it, at a chosen prompt length.

The retrieval-augmented setting of the method's paper, built from text every Python install
ships: the language reference topics of `pydoc_data` (what `help("with")` shows). A prompt
is a run of topics, cut to the wanted number of tokens at a line break, followed by a
question about one of them whose answer is in the text, so a good answer quotes it. The
text is the running Python's own (3.11 here); another version gives other documents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

QUESTIONS = (
    "Using only the documentation above, explain what it says about `{topic}`. Quote the relevant sentences.",
    "According to the documentation above, how does `{topic}` work? Answer with the exact wording where you can.",
)


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return sorted((name, text.strip()) for name, text in topics.items() if len(text) > 400)


def documentation() -> str:
    """All the documentation text the questions are drawn from (about 110k tokens)."""
    return "\n\n".join(f"## {name}\n\n{body}" for name, body in _topics())


def _cut(lines: Sequence[str], count: Callable[[str], int], budget: int) -> str:
    """The most leading lines whose text has at most `budget` tokens (binary search over the line count)."""
    low, high = 0, len(lines)
    while low < high:
        middle = (low + high + 1) // 2
        if count("\n".join(lines[:middle])) <= budget:
            low = middle
        else:
            high = middle - 1
    return "\n".join(lines[:low])


def doc_question(count: Callable[[str], int], tokens: int, index: int = 0) -> str:
    """Documentation of about `tokens` tokens (as `count` counts them) and a question on it; `index` varies both.

    Documents start at a different topic for each index, wrap around the topics, and the
    question asks about the topic in the middle of what was kept.
    """
    topics = _topics()
    start = (index * 7) % len(topics)
    chosen: list[tuple[str, str]] = []
    text = ""
    for name, body in (topics[(start + i) % len(topics)] for i in range(len(topics))):
        chosen.append((name, body))
        text = "\n\n".join(f"## {n}\n\n{b}" for n, b in chosen)
        if count(text) >= tokens:
            break
    question = QUESTIONS[index % len(QUESTIONS)].format(topic=chosen[len(chosen) // 2][0])
    documents = _cut(text.splitlines(), count, max(tokens - count(question) - 24, 1))  # 24: the chat template
    return f"{documents}\n\n{question}"
