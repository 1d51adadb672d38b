"""The GGUF file format: a header read with limits, its vocabulary as a tokenizer, conversion into a model folder."""
