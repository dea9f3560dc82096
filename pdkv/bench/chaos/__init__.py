"""`pdkv bench chaos`: 1P1D through the proxy under client cancels and a prefill restart (`cli`;
`load`: the seeded request plan and its client)."""
