"""pdkv's benchmarks (a tools layer: the runtime never imports it). One subpackage per family
(`serve`, `offline`, `transfer`, `handoff`, `pool`, `compare`, `chaos`, `dcp`, `hetero`,
`groups`, `model`), single-module benchmarks (`memory`, `prefill_cap`) and shared helpers
(`results`, `netns`, `pd_legs`); `registry` lists the `pdkv bench` / `pdkv compare` subcommands
that `pdkv.cli` builds its parser from."""
