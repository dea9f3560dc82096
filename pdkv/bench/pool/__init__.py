"""`pdkv bench pool`: TTFT of a long prompt cold vs hot per KV pool tier and load GB/s (`cli`,
`runner`, `report`)."""
