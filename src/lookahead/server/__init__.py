"""OpenAI-compatible HTTP server: one engine and one shared trie for every request.

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client): `pip install 'lookahead[serve]'`.
"""

from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
