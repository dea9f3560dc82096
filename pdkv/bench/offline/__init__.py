"""`pdkv bench offline`: prefill / decode tok/s of pdkv against HF transformers and llama.cpp
(`cli` flags and entry, `prompts`, `measure`, `runner`, `backends`, `report`, `llamacpp` and its
GGUF conversion `llamacpp_gguf`)."""
