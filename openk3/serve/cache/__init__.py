"""The engine's hybrid cache: MLA pages and KDA state slots (manager.py), the KDA-aware prefix cache and its host and disk tiers."""
