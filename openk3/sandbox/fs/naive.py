"""Reference snapshots: a full copy of the sandbox's merged tree, and its restore by copying back.

Obviously correct and slow (cost grows with the whole tree, not the change set): the overlay snapshots in namespace/backend.py must
produce the same trees (tests compare digests), and benchmarks/sandbox.py measures them against this as the baseline.
"""

from __future__ import annotations

import os
import shutil

from openk3.sandbox.fs import tree


def snapshot(root: str, dst: str) -> None:
    """Copy the tree as the sandbox sees it (the merged overlay view, so no whiteouts) to a new directory `dst`."""
    tree.copy_tree(root, dst)


def restore(snap: str, root: str) -> None:
    """Make `root` identical to `snap`: empty it, then copy everything back."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    for name in os.listdir(snap):
        src = os.path.join(snap, name)
        st = os.lstat(src)
        if os.path.isdir(src) and not os.path.islink(src):
            tree.copy_tree(src, os.path.join(root, name))
        else:
            tree.copy_entry(src, os.path.join(root, name), st)
