"""Acceptance: which draft nodes the model agrees with, given its choice at every node."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..drafting.tree import DraftTree

if TYPE_CHECKING:
    from .generation import Generation
    from .sampling import TokenChooser

Choice = Callable[[int, list[int]], int]
"""The model's token at a block index, given the draft tokens accepted above it."""


def node_choice(generation: Generation, logits: Any, tokens: Sequence[int]) -> Choice:
    """The generation's choice at a node of a block whose logits are `logits[node]` (torch or numpy), after `tokens`."""
    chooser = chooser_of(generation)
    context = list(tokens)
    return lambda node, path: chooser.choose(logits[node], context + path)


def chooser_of(generation: Generation) -> TokenChooser:
    if generation.chooser is None:
        raise ValueError("a generation verified on a model needs a token chooser")
    return generation.chooser


def accept(tree: DraftTree, choose: Choice) -> tuple[list[int], list[int]]:
    """Walk down from the root while the model's choice is a child of the current node.

    `choose(i, path)` is the model's token at block index i (0 = root), where `path` is the
    list of draft tokens accepted so far; it is asked only for the nodes the walk visits, in
    order. Greedy: the argmax. Sampling: a draw from the node's processed distribution; the
    walk then follows the drawn token, so every emitted token is distributed exactly as in
    plain sampling ("sample, then match"). Returns the block indices of the accepted draft
    nodes and the emitted tokens: the accepted tokens plus the token chosen where the walk
    stops, so a step always emits at least one token.
    """
    children = tree.children()
    accepted: list[int] = []
    emitted: list[int] = []
    node = 0
    while True:
        token = choose(node, emitted)
        emitted.append(token)
        child = children[node].get(token)
        if child is None:
            return accepted, emitted
        accepted.append(child)
        node = child


def accept_greedy(tree: DraftTree, choices: list[int]) -> tuple[list[int], list[int]]:
    """`accept` with the model's choices for every block index known up front (`choices[i]`)."""
    return accept(tree, lambda node, _path: choices[node])
