"""`pdkv up` and the processes it starts: the topology launcher, the pool tier servers
(redis-server; mooncake_master plus its store process), the one free-port chooser and the demo.
Above the runtime: the server, engine and router never import it."""
