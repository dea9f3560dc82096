"""`pdkv bench dcp`: KV bytes per rank and decode step time against dcp 1 at long contexts
(`cli`; `report`: the torch-free arithmetic and table)."""
