"""A remote OpenAI-compatible engine (vLLM, SGLang, llama.cpp's server, another webchat) behind the Backend seam."""
