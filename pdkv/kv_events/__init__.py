"""KV cache events in vLLM's schema and transport (issue 34): what the prefix cache stored and
dropped, published over ZMQ for routers that index engines' caches.

`schema` (msgspec structs, torch-free: the block pool records them) and `config` (the frozen
`--kv-events-config`) import nothing heavy; `publisher` (pyzmq, a background thread) is imported
only by the engine when events are on. docs/KV_EVENTS.md has the wire format and its vLLM source.
"""
