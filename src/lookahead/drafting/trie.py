"""TokenTrie: n-grams seen before, and the draft trees they suggest; a long-lived, bounded index.

Two kinds of n-grams live here. Output n-grams (what the model generated, or a corpus) are
shared by every request and stay, under a node budget. Prompt n-grams belong to one request:
its prompt is kept as a PromptIndex (the tokens and their suffix array, 8 bytes a token, no
node per n-gram), freed whole by `finish`, so a long prompt leaves nothing behind and
concurrent requests never see each other's prompts. Drafting reads both through one seam
(sources.py) and pools their counts.

A node's count is the number of times its n-gram was seen; child count / parent count
estimates the chance that the child token follows, and the product along a path the chance
that a draft path is accepted. Pure Python and numpy: no torch, no model. Every public
method holds one lock (the recycled table has its own), so threads may share a trie.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from numbers import Integral
from os import PathLike
from typing import Any

import numpy as np

from ..config import (
    DEFAULT_TRIE_HALF_LIFE,
    DEFAULT_TRIE_MAX_NODES,
    LookaheadConfig,
    check_half_life,
    check_max_nodes,
    check_ngram_length,
    check_recycled,
    is_finite_number,
    is_int,
)
from .choices import ModelChoices
from .ngrams import CORPUS, FOLLOWED, MAX_TOKEN, OUTPUT, OVERRULED, RECYCLED, NgramStore
from .prompt_index import PromptIndex
from .recycled import RecycledTable, rank_ratio
from .sources import DraftSource, StoreSource
from .tree import DraftTree
from .triefile import MODEL_NEXT_COLUMN, RECYCLED_COLUMN, TrieSettings, read_trie, tokenizer_fingerprint, write_trie

EdgeChance = Callable[[int, float, bool, int, int], float]
"""Chance a draft node is accepted once its parent is, from its source flags, count ratio, depth > 1, the tokens of
the context its tree's root matched and how often its n-gram was seen."""

_Place = tuple[DraftSource, Any, int]
"""A source, a handle in it and the handle's count: one of the places where a pooled draft node was seen."""

KEEP_AFTER_EVICTION = 0.9
"""An eviction frees a tenth of the budget, so it runs rarely and its cost is spread thin."""
SCAN_CHILDREN = 16
"""Children looked at per expanded node and source (the shared store's most recently seen, a
prompt index's most frequent; see their `children`): a node of a large trie can have
thousands, and scanning them all made one retrieval take tens of milliseconds. On the recorded
benchmark prompts 8, 16, 48 or all give the same tokens per step (within 0.1 %)."""
_RESCALE_AT = 64.0
"""Weights grow as 2**(age / half_life); past 2**64 they are scaled back down together."""
_MOST_PER_SIGHTING = 2.0 ** (_RESCALE_AT + 1)
"""Bound on the weight one sighting adds (2**_RESCALE_AT, with a margin): a file's weight above
count times this could only grow to infinity, and make the next save unreadable."""


class _Feed:
    """Incremental insertion state of one growing sequence: the n-grams that can still grow."""

    __slots__ = ("last", "length", "open_nodes", "source", "store")

    def __init__(self, store: NgramStore, length: int, source: int) -> None:
        self.store = store
        self.length = length
        self.source = source
        self.open_nodes: list[int] = []
        self.last: int | None = None
        """The last token pushed (None: none yet)."""

    def push(self, tokens: Sequence[int], boundary_ids: frozenset[int], weight: float) -> None:
        """Extend every open n-gram by each token and open a new one: O(n-gram length) a token.

        A boundary token (end of turn) ends every open n-gram: inside a chat prompt it
        separates turns, it does not end the prompt.
        """
        store, keep, source = self.store, 1 - self.length, self.source
        nodes = self.open_nodes
        for token in tokens:
            nodes.append(0)
            nodes = store.advance(nodes, token, weight, source)[keep:]
            if token in boundary_ids:
                nodes = []
        self.open_nodes = nodes
        if len(tokens):
            self.last = tokens[-1]


def _boundary_set(boundary_ids: Iterable[int]) -> frozenset[int]:
    """The boundary ids as a set; ValueError for anything but token ids (they come from files too)."""
    ids = list(boundary_ids) if isinstance(boundary_ids, Iterable) and not isinstance(boundary_ids, str) else None
    if ids is None or not all(isinstance(t, Integral) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN for t in ids):
        raise ValueError(f"boundary_ids must be token ids in [0, {MAX_TOKEN}], got {boundary_ids!r:.80}")
    return frozenset(int(t) for t in ids)


def _check_tokens(tokens: Sequence[int]) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) > MAX_TOKEN):
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN}]")


class _Expansion:
    """One best-first draft tree: the children of a node from the pooled places of its n-gram and the recycled table."""

    def __init__(
        self,
        budget: int,
        branching: bool,
        chance: EdgeChance | None,
        followers: Callable[[int], list[int]] | None,
        min_score: float,
        floors: Callable[[], Sequence[float]] | None,
        matched: int,
        choices: ModelChoices,
    ) -> None:
        self.budget = budget
        self.choices = choices
        """What the model's output last had after each token, to flag children by (TokenTrie._choices)."""
        self.floors = floors
        self.branching = branching
        self.chance = chance
        self.followers = followers
        self.min_score = min_score
        self.tree = DraftTree(matched=matched)
        # heap entries: (-path chance, tie-break, token, parent block index, depth, count ratio, flags, times seen,
        # places)
        self.heap: list[tuple[float, int, int, int, int, float, int, int, list[_Place]]] = []
        self.counter = 0

    def best_first(self, start: list[_Place], root: int, max_depth: int) -> DraftTree:
        """The tree grown from `root` (whose n-gram lies at the places `start`), likeliest node first."""
        tree, heap = self.tree, self.heap
        self.push_children(start, root, 0, 1.0, 1)
        floors = self.floors() if self.floors is not None and heap else None  # priced only when there is a node
        taken = 1.0  # one for the root's own token, plus the chances of the nodes so far
        while heap and len(tree.tokens) < self.budget:
            neg_chance, _, token, parent, depth, ratio, flag, seen, places = heapq.heappop(heap)
            if floors is not None and -neg_chance < taken * floors[len(tree.tokens)]:
                break  # neither this node nor any after it (none likelier) would be sent
            taken -= neg_chance
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.ratios.append(ratio)
            tree.sources.append(flag)
            tree.chances.append(-neg_chance)
            tree.seen.append(seen)
            if depth < max_depth:
                self.push_children(places, token, len(tree.tokens), -neg_chance, depth + 1)
        return tree

    def push_children(self, places: list[_Place], token: int, parent: int, path_chance: float, depth: int) -> None:
        """Queue the children of the node at block index `parent` (holding `token`), each with its path's chance."""
        total = sum(count for _, _, count in places)
        pooled: dict[int, list[_Place]] = {}
        weight: dict[int, int] = {}
        flags: dict[int, int] = {}
        for source, handle, _ in places:
            for child, count, flag, place in source.children(handle, SCAN_CHILDREN):
                pooled.setdefault(child, []).append((source, place, count))
                weight[child] = weight.get(child, 0) + count
                flags[child] = flags.get(child, 0) | flag
        followed = self.choices.choice(token)
        if followed is not None:  # the model's own last choice after this token confirms one child, overrules the rest
            for child in flags:
                flags[child] |= FOLLOWED if child == followed else OVERRULED
        keep = self.budget - len(self.tree.tokens) if self.branching else 1
        deep, chance, matched = parent > 0, self.chance, self.tree.matched
        ratios = {child: weight[child] / total for child in heapq.nlargest(keep, weight, key=weight.__getitem__)}
        edges = {
            child: ratio if chance is None else chance(flags[child], ratio, deep, matched, weight[child])
            for child, ratio in ratios.items()
        }
        guesses: dict[int, float] = {}
        for rank, child in enumerate(self.followers(token)[:keep] if self.followers else ()):
            ratio = rank_ratio(rank)
            edge = ratio if chance is None else chance(RECYCLED, ratio, deep, matched, 0)
            if child in edges:  # retrieval kept it too: the likelier of the two estimates
                flags[child] |= RECYCLED
                edges[child] = max(edges[child], edge)
            elif child not in guesses:  # the model's guess (places retrieval scanned stay, for its children)
                ratios[child], flags[child], guesses[child] = ratio, RECYCLED, edge
        # at most one child of a node is accepted: learned chances of siblings cannot add up past 1, and the
        # model's guesses share only what retrieval leaves (a copied run keeps its chance at every depth)
        found = sum(edges.values())
        share = 1.0 / max(1.0, found)
        if guesses:  # (without them, the retrieved children alone: no dict rebuilt on this path)
            room = max(0.0, 1.0 - found) / max(sum(guesses.values()), 1.0 - found, 1e-12)
            edges = {child: edge * share for child, edge in edges.items()}
            edges.update({child: guess * room for child, guess in guesses.items()})
            share = 1.0
            if len(edges) > keep:
                edges = dict(heapq.nlargest(keep, edges.items(), key=lambda item: item[1]))
        for child, edge in edges.items():
            child_chance = path_chance * edge * share
            if child_chance > self.min_score:
                self.counter += 1
                entry = (-child_chance, self.counter, child, parent, depth, ratios[child], flags[child],
                         weight.get(child, 0), pooled.get(child, []))  # fmt: skip
                heapq.heappush(self.heap, entry)


class TokenTrie:
    """The shared n-gram index of an engine, plus one private prompt index per live request.

    Eviction rule: counts with exponential decay. Each time an n-gram is seen its weight grows
    by 2**(t / half_life), t being the number of tokens learned so far, and when the index
    exceeds `max_nodes` the lowest-weight nodes (with everything below them) are freed until
    90 % of the budget is left. Why decayed counts: plain counts never let a new n-gram in
    (it always has the lowest count) and keep stale ones forever; plain recency (LRU) throws
    out phrases that recur every day in favour of one-off ones. A decayed count keeps what is
    both frequent and still in use; half_life sets how many old sightings one new one is
    worth, and `half_life=None` gives plain counts. Drafting still ranks by plain counts, so
    the rule decides only what is kept, never which draft is proposed from what is kept.
    """

    def __init__(
        self,
        ngram_length: int = 12,
        boundary_ids: Iterable[int] = (),
        max_nodes: int | None = DEFAULT_TRIE_MAX_NODES,
        half_life: float | None = DEFAULT_TRIE_HALF_LIFE,
        recycled: int = 0,
    ) -> None:
        check_ngram_length(ngram_length)
        check_max_nodes(max_nodes)
        check_half_life(half_life)
        check_recycled(recycled)
        self.ngram_length = ngram_length
        self.boundary_ids = _boundary_set(boundary_ids)
        self.max_nodes = max_nodes
        self.half_life = half_life
        self.tokenizer_id: str | None = None
        """Fingerprint of the tokenizer whose ids these are; set by the engine or a loaded file."""
        self.loaded_from: str | None = None
        """The file this trie was loaded from, named in the errors its contents cause later."""
        self._shared = NgramStore()
        self._age = 0.0  # tokens learned since the weights were last rescaled
        self._learned = 0
        self._evicted = 0
        self._prompts: dict[Hashable, PromptIndex] = {}
        self._feeds: dict[Hashable, _Feed] = {}
        self._recycled = RecycledTable(recycled) if recycled else None
        """Each token's likeliest next tokens as the model last computed them (recycled.py); None: not kept."""
        self._choices = ModelChoices()
        """What the model's output last had after each token (choices.py); saved with the trie."""
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, config: LookaheadConfig, boundary_ids: Iterable[int]) -> TokenTrie:
        """An empty trie for drafting with `config`; `boundary_ids` (end of turn) separate n-grams."""
        return cls(config.ngram_length, boundary_ids, config.trie_max_nodes, config.trie_half_life, config.recycled)

    def __len__(self) -> int:
        """Nodes in the shared index (the prompts of live requests are not nodes).

        Under the lock like every public method: another thread's learning adds nodes before
        it evicts, and a reader between the two would see the budget exceeded.
        """
        with self._lock:
            return len(self._shared)

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Adopt a tokenizer, or refuse one other than the tokenizer this trie was built with."""
        fingerprint = tokenizer_fingerprint(tokenizer)
        with self._lock:
            if self.tokenizer_id is None:
                self.tokenizer_id = fingerprint
            elif self.tokenizer_id != fingerprint:
                raise ValueError(
                    f"this trie was built with another tokenizer (vocabulary {self.tokenizer_id[:12]}, the model's "
                    f"is {fingerprint[:12]}): its token ids would mean other words"
                )

    def check_vocabulary(self, size: int) -> None:
        """Refuse a trie holding a token id of `size` or more: the model has no embedding for it.

        Without this check a trie built for a larger vocabulary loads, and then every step
        that drafts one of those ids fails inside the model.
        """
        with self._lock:
            largest = int(np.frombuffer(self._shared.token, dtype=np.int32).max())
            if self._recycled is not None:
                largest = max(largest, self._recycled.largest_token())
            largest = max(largest, self._choices.largest_token())
        if largest >= size:
            raise ValueError(
                f"{self.loaded_from or 'the trie'}: token id {largest} is outside the model's vocabulary of {size} "
                "tokens: the trie was built for another model"
            )

    # ---- learning ---------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], request: Hashable | None = None) -> None:
        """Add every n-gram of `tokens`: to `request`'s prompt index, or shared (as corpus) if no request.

        A second prompt for the same request is joined to the first (no n-gram spans the two).
        A prompt is indexed before the lock is taken: other requests go on drafting meanwhile.
        """
        _check_tokens(tokens)
        if request is not None:
            index = PromptIndex(tokens, self.ngram_length, self.boundary_ids)
            with self._lock:
                known = self._prompts.get(request)
                self._prompts[request] = index if known is None else known.joined(index)
            return
        with self._lock:
            self._learn(_Feed(self._shared, self.ngram_length, CORPUS), tokens)

    def observe(self, request: Hashable, new_tokens: Sequence[int], source: str = "output") -> None:
        """Learn a request's newly accepted tokens into the shared index, incrementally.

        `source="corpus"` marks text inserted to warm the index rather than generated.
        """
        _check_tokens(new_tokens)
        with self._lock:
            feed = self._feeds.get(request)
            if feed is None:
                flag = {"output": OUTPUT, "corpus": CORPUS}[source]
                feed = self._feeds[request] = _Feed(self._shared, self.ngram_length, flag)
            self._learn(feed, new_tokens)

    def learn_answer(self, tokens: Sequence[int]) -> None:
        """Learn a whole answer generated elsewhere (another replica) as its own generation would have.

        The same n-grams and counts as `observe` (in any pieces) and `finish` give, and the same
        weights as one piece: a replica applying another's answers drafts as one engine serving
        both would (weights decide eviction only, never a draft).
        """
        _check_tokens(tokens)
        with self._lock:
            self._learn(_Feed(self._shared, self.ngram_length, OUTPUT), tokens)

    def recycle(self, keys: Sequence[int], following: np.ndarray) -> None:
        """The model's likeliest next tokens after each of `keys` (`following[i]`, likeliest first), kept for drafting.

        Nothing is kept by a trie made without a recycled table (LookaheadConfig.recycled = 0).
        """
        if self._recycled is not None:
            _check_tokens(keys)
            self._recycled.update(keys, following)

    @property
    def recycled(self) -> RecycledTable | None:
        """The recycled table (None: this trie keeps none)."""
        return self._recycled

    def _learn(self, feed: _Feed, tokens: Sequence[int]) -> None:
        weight = 1.0 if self.half_life is None else 2.0 ** (self._age / self.half_life)
        if feed.source == OUTPUT:
            self._choices.learn(feed.last, tokens)
        feed.push(tokens, self.boundary_ids, weight)
        self._age += len(tokens)
        self._learned += len(tokens)
        self._rescale_if_due()
        if self.max_nodes is not None and len(self._shared) > self.max_nodes:
            self._evict(math.floor(self.max_nodes * KEEP_AFTER_EVICTION))

    def _rescale_if_due(self) -> None:
        """Scale the weights back down once new sightings would weigh more than 2**_RESCALE_AT."""
        if self.half_life is not None and self._age / self.half_life > _RESCALE_AT:
            self._shared.rescale(2.0 ** -(self._age / self.half_life))
            self._age = 0.0

    def _evict(self, keep: int) -> None:
        store = self._shared
        self._evicted += len(store.evict(keep))
        tokens = store.token
        for feed in self._feeds.values():  # freed rows will be reused: forget them
            feed.open_nodes = [node for node in feed.open_nodes if tokens[node] >= 0]

    def finish(self, request: Hashable) -> None:
        """Free a request's prompt index and end its output feed; what it generated stays shared."""
        with self._lock:
            self._prompts.pop(request, None)
            self._feeds.pop(request, None)

    # ---- drafting ---------------------------------------------------------------------

    def retrieve(
        self,
        context: Sequence[int],
        budget: int,
        max_depth: int,
        request: Hashable | None = None,
        match_length: int = 4,
        branching: bool = True,
        min_score: float = 0.0,
        chance: EdgeChance | None = None,
        floors: Callable[[], Sequence[float]] | None = None,
    ) -> DraftTree:
        """Best-first draft tree below the longest matched tail of `context`, and from the recycled table.

        The prompt index of `request` and the shared index are searched together: a
        candidate's ratio is its pooled count over its parent's pooled count; the product of
        ratios along a path estimates the chance the path is accepted. With a recycled table,
        every node (the root too) also offers the model's own likeliest next tokens after its
        token (flagged RECYCLED; ratio 1 / (rank + 1) unless retrieval found it as well). Where
        the model's output had a token after a node's token before, the child retrieval offers
        that is that token is flagged FOLLOWED and its siblings OVERRULED. Nodes
        are taken in order of that chance, or of the product along the path of `chance(source flags,
        count ratio, parent is a draft node, tokens matched, times seen)` when the caller has learned
        better (the adaptive policy), and listed in that order with those chances, so every
        prefix of the tree is a tree. At most `budget` nodes, `max_depth` deep, and none past the
        first whose chance is under its floor (policy.floor_factors: `floors()[i]` times 1 + the
        chances before it, for the node at place i + 1; nodes after it are no likelier; `floors()`,
        called once there is a node to take, under the trie's lock, has at least `budget` entries); with
        `branching` off, a single path (for models that cannot take a tree mask). The Python
        work done is bounded by the budget times SCAN_CHILDREN per source, whatever the trie's
        or the prompt's size (a prompt index adds one numpy pass over a wide node's occurrences).
        """
        if budget < 1 or max_depth < 1 or not context:
            return DraftTree()
        with self._lock:
            sources: list[DraftSource] = [StoreSource(self._shared)]
            if request is not None and request in self._prompts:
                sources.append(self._prompts[request])
            start, matched = self._match(context, sources, match_length)
            followers = None if self._recycled is None else self._recycled.followers
            if not start and followers is None:
                return DraftTree()
            expand = _Expansion(budget, branching, chance, followers, min_score, floors, matched, self._choices)
            return expand.best_first(start, context[-1], max_depth)

    @staticmethod
    def _match(context: Sequence[int], sources: list[DraftSource], match_length: int) -> tuple[list[_Place], int]:
        """Places of the longest context tail (≤ match_length) that some source continues, with their counts, and
        that tail's length (none: ([], 0))."""
        for length in range(min(match_length, len(context)), 0, -1):
            tail = context[-length:]
            found = []
            for source in sources:
                handle = source.match(tail)
                if handle is not None:
                    found.append((source, handle, source.count(handle)))
            if found:
                return found, length
        return [], 0

    # ---- introspection ----------------------------------------------------------------

    def stats(self) -> dict[str, int | None]:
        with self._lock:
            return {
                "shared_nodes": len(self._shared),
                "max_nodes": self.max_nodes,
                "bytes": self._shared.nbytes(),
                "tokens_learned": self._learned,
                "evicted_nodes": self._evicted,
                "live_requests": len(self._prompts),
                "prompt_tokens": sum(len(index) for index in self._prompts.values()),
                "prompt_bytes": sum(index.nbytes() for index in self._prompts.values()),
                "recycled_tokens": None if self._recycled is None else len(self._recycled),
                "model_choices": len(self._choices),
            }

    def sources(self) -> dict[str, int]:
        """Shared nodes by where their n-gram was seen: model output, corpus, or both."""
        with self._lock:
            flags = np.frombuffer(self._shared.source, dtype=np.uint8)[self._shared.live()]
            return {
                "output": int((flags == OUTPUT).sum()),
                "corpus": int((flags == CORPUS).sum()),
                "both": int((flags == OUTPUT | CORPUS).sum()),
            }

    def most_frequent(self, length: int, top: int) -> list[tuple[list[int], int]]:
        """The `top` most frequent shared n-grams of exactly `length` tokens, with their counts."""
        with self._lock:
            store = self._shared
            nodes = np.flatnonzero(store.depths() == length)
            counts = np.frombuffer(store.count, dtype=np.int64)[nodes]
            best = nodes[np.argsort(-counts, kind="stable")[:top]]
            return [(store.path(int(node)), store.count[int(node)]) for node in best]

    # ---- persistence ------------------------------------------------------------------

    def save(self, path: str | PathLike[str]) -> None:
        """Write the shared index, the recycled table and the model's choices to `path` atomically (see triefile
        for the format)."""
        with self._lock:
            settings = TrieSettings(
                ngram_length=self.ngram_length,
                boundary_ids=sorted(self.boundary_ids),
                max_nodes=self.max_nodes,
                half_life=self.half_life,
                age=self._age,
                tokens_learned=self._learned,
                tokenizer_id=self.tokenizer_id,
                recycled=0 if self._recycled is None else self._recycled.k,
            )
            columns = self._shared.export()
            if self._recycled is not None:
                columns[RECYCLED_COLUMN] = self._recycled.rows
            if len(self._choices):
                columns[MODEL_NEXT_COLUMN] = self._choices.column()
        write_trie(path, columns, settings)

    @classmethod
    def load(cls, path: str | PathLike[str], max_nodes: int | str | None = "saved") -> TokenTrie:
        """A trie read from `path`; ValueError, naming the file and the problem, if it is not a sound trie file.

        `max_nodes` overrides the saved budget (None: no budget); a file larger than the
        budget is trimmed by eviction on load. A file is data from anywhere: every value in it
        is checked against what a save can write, and refused if it is not, but one: an age of
        more than _RESCALE_AT half-lives is rescaled away, as learning on would have done.
        """
        if max_nodes != "saved":
            check_max_nodes(max_nodes)  # the caller's mistake, not the file's
        columns, settings = read_trie(path)
        budget = settings.max_nodes if max_nodes == "saved" else max_nodes
        try:
            trie = cls(settings.ngram_length, settings.boundary_ids, budget, settings.half_life, settings.recycled)
            trie._restore(columns, settings)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: malformed trie file ({err})") from err
        trie.loaded_from = str(path)
        if trie.max_nodes is not None and len(trie) > trie.max_nodes:
            trie._evict(trie.max_nodes)
        return trie

    def _restore(self, columns: dict[str, np.ndarray], settings: TrieSettings) -> None:
        """Adopt a file's nodes and learning state, refusing any value a save could not have written."""
        store = NgramStore.from_columns(columns)
        deepest = int(store.depths().max())
        if deepest > self.ngram_length:
            raise ValueError(f"it holds a {deepest}-gram, longer than its n-gram length {self.ngram_length}")
        if (columns["weight"] > columns["count"] * _MOST_PER_SIGHTING).any():
            raise ValueError("a weight is larger than its count of sightings can make it")
        age, learned, tokenizer_id = settings.age, settings.tokens_learned, settings.tokenizer_id
        if not (is_finite_number(age) and age >= 0):
            raise ValueError(f"age must be a finite number, not negative, got {age!r}")
        if not (is_int(learned) and learned >= 0):
            raise ValueError(f"tokens_learned must be a whole number, not negative, got {learned!r}")
        if not (tokenizer_id is None or isinstance(tokenizer_id, str)):
            raise ValueError(f"tokenizer_id must be text or null, got {tokenizer_id!r}")
        if RECYCLED_COLUMN in columns:
            table = RecycledTable.from_rows(columns[RECYCLED_COLUMN])
            if table.k != settings.recycled:
                raise ValueError(f"its recycled table is {table.k} wide, its settings say {settings.recycled}")
            self._recycled = table
        if MODEL_NEXT_COLUMN in columns:
            self._choices = ModelChoices.from_column(columns[MODEL_NEXT_COLUMN])
        self._shared, self._age, self._learned, self.tokenizer_id = store, float(age), learned, tokenizer_id
        self._rescale_if_due()
