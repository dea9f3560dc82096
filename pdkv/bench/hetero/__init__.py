"""`pdkv bench hetero`: P/D re-blocking and re-sharding cost against a same-layout handoff
(`cli`; `report`: ratios, output check, table)."""
