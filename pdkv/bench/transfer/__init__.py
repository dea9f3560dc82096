"""`pdkv bench transfer`: the KV transfer engines (tcp, shm) against a raw socket and memcpy
in GB/s (`cli`, `payload`, producer processes in `peers`, `runner`, `report`)."""
