"""Tiered KV pool (torch-free): chunk keys, value codec, tiers (dram, disk, redis, mooncake) and
the store that fans out across them. The KV connector that moves blocks in and out of the pool is
`pdkv.kv_transfer.connector.pool`."""
