"""Stops and streamed text, on the default model's real tokenizer (byte-level BPE)."""

import pytest

from lookahead.decoding.transcript import Transcript, stop_strings


def make(tokenizer, stops=(), stop_ids=frozenset(), limit=1000) -> Transcript:
    return Transcript(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), limit, stop_ids, tuple(stops))


def feed_in_steps(transcript: Transcript, tokens: list[int], step: int) -> tuple[list[int], str]:
    """Feed `step` tokens at a time, collecting deltas as a stream would."""
    kept, streamed = [], ""
    for i in range(0, len(tokens), step):
        kept += transcript.extend(tokens[i : i + step])
        streamed += transcript.delta()
        if transcript.done:
            break
    return kept, streamed


TEXTS = ["Plain ASCII text, with punctuation.", "中文文本：你好，世界！", "emoji 🎉🚀 and ünïcödé", "a\n\nb"]  # noqa: RUF001 (full-width punctuation on purpose)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_deltas_concatenate_to_the_decoded_text(tokenizer, text, step):
    tokens = tokenizer(text)["input_ids"]
    transcript = make(tokenizer, limit=len(tokens))
    kept, streamed = feed_in_steps(transcript, tokens, step)
    assert kept == tokens
    assert transcript.finish_reason == "length"
    assert streamed == transcript.text == tokenizer.decode(tokens)
    assert "\ufffd" not in streamed


def test_no_delta_ever_holds_half_a_character(tokenizer):
    tokens = tokenizer("🎉🚀中")["input_ids"]
    assert len(tokens) > 3, "emoji are several byte tokens in this tokenizer"
    transcript = make(tokenizer, limit=100)
    for token in tokens:
        transcript.extend([token])
        assert "\ufffd" not in transcript.delta()


@pytest.mark.parametrize("step", [1, 2, 5, 50])
def test_stop_string_across_token_and_step_boundaries(tokenizer, step):
    text = "first line\nsecond line END tail that must go"
    tokens = tokenizer(text)["input_ids"]
    transcript = make(tokenizer, stops=["END", "never"])
    kept, streamed = feed_in_steps(transcript, tokens, step)
    assert transcript.finish_reason == "stop"
    assert transcript.text == streamed == "first line\nsecond line "
    assert tokenizer.decode(kept).startswith("first line\nsecond line END")
    assert len(kept) < len(tokens), "tokens after the stop are dropped"


def test_a_stop_prefix_is_held_back_until_it_cannot_be_a_stop(tokenizer):
    transcript = make(tokenizer, stops=["\n\n"])
    transcript.extend(tokenizer("Hello\n")["input_ids"])
    assert transcript.delta() == "Hello"
    transcript.extend(tokenizer("world")["input_ids"])
    assert transcript.delta() == "\nworld"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    transcript = make(tokenizer, stops=["cat", "dog"])
    transcript.extend(tokenizer("my dog and cat")["input_ids"])
    assert transcript.text == "my "


def test_stop_token_is_kept_and_ends_the_text(tokenizer):
    tokens = tokenizer("one two three")["input_ids"]
    transcript = make(tokenizer, stop_ids=frozenset([tokens[1]]))
    assert transcript.extend(tokens) == tokens[:2]
    assert transcript.finish_reason == "stop"


def test_token_limit_inside_a_step(tokenizer):
    tokens = tokenizer("one two three four")["input_ids"]
    transcript = make(tokenizer, limit=2)
    assert transcript.extend(tokens) == tokens[:2]
    assert transcript.finish_reason == "length"


@pytest.mark.parametrize("bad", ["", [""], ["ok", ""], [3]])
def test_bad_stop_strings_are_refused(bad):
    with pytest.raises(ValueError, match="stop"):
        stop_strings(bad)
