"""The rollout side of RL on openk3: routing replay for a trainer's forward, weight sync into a live engine, and agent
episodes whose tools run in openk3 sandboxes (docs/rollouts.md)."""
