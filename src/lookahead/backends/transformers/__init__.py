"""transformers as the runtime: an unmodified causal LM, verified through its public forward().

- backend.py     TransformersBackend: what the engine needs of it
- verifier.py    ModelVerifier: pack, forward, accept, compact
- forward.py     the one call into the model; masks.py its tree masks and positions
- kvcache.py     padded batches of DynamicCache rows; slab.py packed rows (each pays its own tokens)
- attention.py   the attention the engine's own passes use (packed rows, grouped heads on CPUs)
- capability.py  which drafts and batch layouts this model verifies exactly (probed once)
- costs.py       its forward passes timed for the cost curves
"""
