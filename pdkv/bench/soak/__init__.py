"""`pdkv bench soak`: hours of mixed load on P/D + pool and colocated; what it leaves behind."""
