"""`pdkv bench groups`: KV bytes per state group and the P/D handoff of hybrid models (`cli`;
`report`: per-group formulas and real-size figures from `pdkv plan`)."""
