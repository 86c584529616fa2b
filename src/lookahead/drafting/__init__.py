"""The drafting core: where draft trees come from, and how many nodes a step is worth.

Nothing here imports torch or transformers (a test checks it), so the trie, the policy and
the trie file can be used, tested and replayed without a model:

- ngrams.py   NgramStore: one trie of token n-grams in flat arrays, with counts and eviction
- trie.py     TokenTrie: the shared output index plus each live request's prompt index
- prompt_index.py  PromptIndex: one prompt and its suffix array, read as a trie of its n-grams
- sources.py  DraftSource: what retrieval asks of each place where n-grams are kept
- recycled.py RecycledTable: the model's likeliest next tokens after each token, from verification
- tree.py     DraftTree: the candidate continuations of one step (tokens, parents, ratios, sources)
- policy.py   CostModel, Calibration, DraftPolicy: which nodes are worth their cost
- drafter.py  the Drafter protocol, and the trie drafter built from a LookaheadConfig
- triefile.py the safe, checksummed trie file
"""
