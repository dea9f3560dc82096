"""Benchmarks of the model alone, without an engine: `pdkv bench kvquant` (`kv_quant`),
`pdkv bench dtype` (`dtype_parity`) and `python -m pdkv.bench.model.profile_step`."""
