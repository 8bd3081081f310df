"""The launch layer: what an engine is built from (spec.py), the one way to build it (engine.py), and the processes that
serve it (the `openk3 serve` command, its ranks and its replicas). It sits above api/ (HTTP) and scale/ (Ray Serve)."""
