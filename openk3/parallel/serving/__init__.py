"""Multi-rank serving: rank 0 runs the one engine and drives (driver.py, step_channel.py), the other ranks follow with their
own share of the experts (rank_model.py); ranks.py is every rank's start-up, local.py and torchrun.py the two ways to
start the ranks (`LLM(ep=N)`, `torchrun ... openk3 serve --ep N`)."""
