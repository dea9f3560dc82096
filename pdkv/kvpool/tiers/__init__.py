"""Pool tiers, one module each, created by name through `pdkv.kvpool.tiers.factory`."""
