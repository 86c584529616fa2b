"""The drafts view: every kept token's text once, named after its source; a split character waits."""

from lookahead.drafting.ngrams import OUTPUT, PROMPT, RECYCLED
from lookahead.sourceview import COLOURS, SourceView

BYTES = {1: b"a", 2: b" b", 3: "é".encode()[:1], 4: "é".encode()[1:], 5: b"!"}


def decode(ids) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def test_pieces_name_their_source_and_a_split_character_waits_for_its_end():
    view = SourceView(decode)
    assert view.add([1, 2], [0, PROMPT]) == [("a", "model"), (" b", "prompt")]
    assert view.add([3], [OUTPUT | PROMPT]) == []  # half of "é"
    assert view.add([4, 5], [OUTPUT, RECYCLED]) == [("é", "answers"), ("!", "recycled")]
    assert view.taken == 5 and view.flush() == []
    assert view.counts == {"model": 1, "prompt": 2, "answers": 1, "recycled": 1}
    assert view.summary(2) == "5 tokens in 2 steps (2.50 tokens per step): model 1, prompt 2, answers 1, recycled 1"
    assert view.add([3], [PROMPT]) == [] and view.flush() == [("\ufffd", "prompt")]  # an answer cut mid-character


def test_every_source_name_has_a_colour():
    from lookahead.drafting.ngrams import SOURCE_NAMES, source_name

    assert set(COLOURS) == set(SOURCE_NAMES)
    assert {source_name(flags) for flags in range(16)} == set(SOURCE_NAMES)
