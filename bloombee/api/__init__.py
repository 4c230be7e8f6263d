"""OpenAI-compatible HTTP API over the swarm (`bloombee-api`): `create_app` builds the FastAPI app."""

from bloombee.api.app import create_app

__all__ = ["create_app"]
