"""`pdkv compare`: one workload on colocated, P/D, P/D + pool, ... topologies, cold and hot,
one report (`cli` runs it; `args`, `topologies`, `netns`, `phases`, `report`, `plan`, `explain`,
`plots`, `output`), and `routing`: the PD-colocated routing-policy comparison."""
