"""File trees for overlay layers: tree.py (copy, digest, squash, tar.zst), layers.py (the content-addressed layer store),
rootfs.py (the base rootfs), safefs.py (host-side access confined to a sandbox root), naive.py (reference snapshots)."""
