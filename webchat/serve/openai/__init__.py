"""The OpenAI-compatible API: request schema, routes, streaming and response formatting."""
