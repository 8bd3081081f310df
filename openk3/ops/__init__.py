"""The math of the model, one op per package or file, each with a naive reference, chosen through the registry (registry.py)."""
