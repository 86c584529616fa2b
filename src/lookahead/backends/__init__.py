"""The runtimes a model can verify drafts on, each behind the Backend seam (decoding/backend.py).

- transformers/  an unmodified transformers model (the reference for exactness)
- llamacpp/      a GGUF model on llama.cpp, through llama-cpp-python's C API
"""
