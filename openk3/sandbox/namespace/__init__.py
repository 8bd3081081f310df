"""Namespace sandboxes ("sb-" ids, "snap-" fs snapshots): NamespaceBackend (lifecycle.py, backend.py) over instances
(instance.py), their background standbys (standby.py) and shell sessions (shell.py), configured by settings.py."""
