"""Acceptance: which draft nodes the model agrees with, given its choice at every node."""

from __future__ import annotations

from .draft import DraftTree


def accept_greedy(tree: DraftTree, choices: list[int]) -> tuple[list[int], list[int]]:
    """Walk down from the root while the model's choice is a child of the current node.

    `choices[i]` is the model's token at block index i (0 = root). Returns the block indices
    of the accepted draft nodes and the emitted tokens: the accepted tokens plus the bonus
    token chosen where the walk stops, so a step always emits at least one token.
    """
    children = tree.children()
    accepted: list[int] = []
    node = 0
    while (child := children[node].get(choices[node])) is not None:
        accepted.append(child)
        node = child
    emitted = [tree.tokens[i - 1] for i in accepted]
    emitted.append(choices[node])
    return accepted, emitted
