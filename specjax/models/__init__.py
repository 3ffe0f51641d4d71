"""The target model and what it is built from: its config (`config`), the decoder layer
shared with the drafters (`layers`, `matmul`), the transformer (`model`), its prefill
(`prefill`), layer-major KV cache (`kv_cache`) and cache attention (`attention`), and the
checkpoint and tokenizer I/O that load and save it (`checkpoint`, `tokenizer`)."""
