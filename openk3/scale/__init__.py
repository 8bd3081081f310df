"""Scale-out on Ray Serve: N engine replicas behind one OpenAI-compatible front end, routed by cached prefix.

`prefix_table.py` is the routing rule (pure), `prompt_keys.py` turns a request into the engine's 64-token match-unit keys,
`router.py` plugs the rule into Ray Serve's request router, `replica.py` runs one openk3 server per replica, `forward.py`
is the failure rule (retry once before any byte, else 503), `pull_hints.py` and `prefix_pull.py` the cross-replica prefix pull
(the router's hint; a replica's pull and export), `health_board.py` the front end's background health probes
(what /health reads, and what tells a prefill call its pool is down), `frontend.py` the ingress with the aggregated /health
and /metrics, `deploy.py` the `serve.run` entry, `replica_launch.py` what the launch layer hands down (the flags and how a
replica builds its server), `cluster.py` a bounded Ray start-up (a local cluster in a process group of its own), `cli.py`
`openk3 serve --replicas N`.
"""
