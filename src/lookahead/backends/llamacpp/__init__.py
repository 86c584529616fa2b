"""llama.cpp as a second engine: GGUF models run as they are, verified by llama.cpp's own step.

- model.py     LlamaCppModel: the GGUF file loaded through llama-cpp-python's C API, one shared
               context, its vocabulary checked against the transformers tokenizer
- verifier.py  LlamaCppVerifier: a draft tree in one `llama_decode` (a sequence id per leaf),
               the accepted path kept on the request's own sequence
- backend.py   what the engine needs of it: the verifier, the limits, the price of its steps

Nothing here imports llama_cpp until a model is loaded: `pip install 'lookahead[llama]'`.
"""
