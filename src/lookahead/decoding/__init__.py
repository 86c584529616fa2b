"""Decoding: the only code that calls the model.

- engine.py      LookaheadEngine: generate, stream, chat; checks each request
- generation.py  one sequence's state between steps, its stats and its output
- step.py        one step over a list of generations (draft → verify → keep), the loop, Verifier
- verifier.py    the model's Verifier: pack, forward, accept, compact
- forward.py     the one call into the model; masks.py its tree masks and positions
- kvcache.py     keep the accepted cache entries; verify.py the acceptance walk
- sampling.py    greedy and sampled token choice; transcript.py where a request stops
- capability.py  which drafts this model verifies exactly; costs.py what a forward pass costs
"""
