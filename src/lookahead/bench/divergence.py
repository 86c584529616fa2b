"""Where a method's output first differs from the engine's plain decoding, and how close a call it was.

Speculative decoding is exact only as far as a wide pass rounds like the one-token step. Where
an output differs, the reference's top-2 logit margin at that position tells rounding (a
near-tie: a few hundredths in float32, more in bfloat16) from a bug (a wide margin).
"""

from __future__ import annotations

import numpy as np
import torch


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where `got` differs from `want` (or where the shorter one ends); None if equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))


def reference_margin(model, ids: list[int], reference: list[int], index: int) -> float:
    """Top-2 logit margin where `reference` (the model's plain output after `ids`) takes `index`.

    A transformers model: one forward pass over the context (its own block rounding, close
    enough to tell a near-tie from a wide margin). llama.cpp: its one-token step.
    """
    if not isinstance(model, torch.nn.Module):
        return _llamacpp_margin(model, ids, reference, index)
    context = torch.tensor([ids + reference[:index]], device=model.device)
    with torch.inference_mode():
        logits = model(context).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return round(float(top[0] - top[1]), 4)


def _llamacpp_margin(model, ids: list[int], reference: list[int], index: int) -> float:
    from ..backends.llamacpp.verifier import Entry, LlamaCppDecoder

    decoder, context = LlamaCppDecoder(model), ids + reference[:index]
    with model.lock:
        sequence = model.take_sequence()
        decoder([Entry(token, i, (sequence,), False) for i, token in enumerate(context[:-1])])
        top = np.sort(decoder([Entry(context[-1], len(context) - 1, (sequence,), True)])[0])[-2:]
        model.give_back(sequence)
    return round(float(top[1] - top[0]), 4)
