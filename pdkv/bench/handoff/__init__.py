"""`pdkv bench handoff`: one request's P→D KV handoff, measured against `pdkv plan` (`cli`;
`peer`: P or D as its own process; `compare`: the torch-free prediction and verdict)."""
