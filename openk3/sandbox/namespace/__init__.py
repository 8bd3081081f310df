"""Namespace sandboxes ("sb-" ids, "snap-" fs snapshots): NamespaceBackend (lifecycle.py, backend.py) over instances
(instance.py, whose init's bwrap command line is bwrap.py and whose start-up is read by startup.py), their background standbys (standby.py) and shell sessions
(shell.py), configured by settings.py."""
