"""The batched engine: sequences, sampling, speculation, each connection's streaming handle, neutral events."""
