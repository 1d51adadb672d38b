"""The model: configuration, transformer, ops, the ragged batch, the paged KV cache, loading, quantized weights."""
