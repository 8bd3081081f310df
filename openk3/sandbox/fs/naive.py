"""Reference snapshots: a full copy of the sandbox's merged tree, and its restore by copying back.

Obviously correct and slow (cost grows with the whole tree, not the change set): the overlay snapshots in namespace/backend.py must
produce the same trees (tests compare digests), and benchmarks/sandbox.py measures them against this as the baseline.
"""

from __future__ import annotations

import os

from openk3.sandbox.fs import tree
from openk3.sandbox.fs.safetree import DIR_FLAGS, Tree


def snapshot(root: str, dst: str) -> None:
    """Copy the tree as the sandbox sees it (the merged overlay view, so no whiteouts) to a new directory `dst`."""
    tree.copy_tree(root, dst)


def restore(snap: str, root: str) -> None:
    """Make `root` identical to `snap`: empty it, then copy everything back (following no symlink of either tree)."""
    with Tree(root) as target, Tree(snap) as source:
        listing = target.open("", DIR_FLAGS)
        try:
            names = os.listdir(listing)
        finally:
            os.close(listing)
        for name in names:
            target.remove(name)
        tree.copy_into(source, target)
