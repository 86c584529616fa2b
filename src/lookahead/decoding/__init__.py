"""Decoding, the same on every runtime: the step loop and what flows through it.

- generation.py  one sequence's state between steps, its stats and its output
- step.py        one step over a list of generations (draft → verify → keep); the Verifier seam
- batch.py       continuous batching: joins, leaves, chunked prefill; the loop of one generation
- backend.py     the Backend seam: what the engine asks of a runtime (lookahead/backends/)
- verify.py      the acceptance walk; sampling.py greedy and sampled token choice
- transcript.py  where a request stops, and its streamed text
- costs.py       cost curves: which to measure, timing them, the cache on disk
"""
