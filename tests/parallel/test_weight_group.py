"""WeightGroup (parallel/weight_group.py): tensors of mixed dtypes and sizes arrive exactly, in buckets of one dtype up to
the bucket size (a bigger tensor alone) or one per tensor, between a sender and a receiver thread over loopback."""

import socket
import threading

import pytest
import torch

from openk3.parallel.weight_group import TensorSpec, WeightGroup, buckets, specs_of


def test_buckets_keep_one_dtype_and_the_size() -> None:
    specs = [TensorSpec("a", "float32", (4,)), TensorSpec("b", "float32", (4,)), TensorSpec("c", "bfloat16", (2,)), TensorSpec("d", "float32", (10,))]
    assert buckets(specs, bucket_bytes=32) == [[0, 1], [2], [3]]  # 16 + 16 bytes fit; a dtype change or 40 bytes start anew
    assert buckets(specs, bucket_bytes=0) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="dtype 'int64'"):
        TensorSpec("e", "int64", (1,))


@pytest.mark.parametrize("bucket_bytes", [0, 64])
def test_roundtrip(bucket_bytes) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "v": torch.randn(2, 2, generator=g),
        "big": torch.randn(40, generator=g),  # 160 bytes: alone in its bucket
        "q": torch.randint(0, 255, (4, 3), generator=g, dtype=torch.uint8),
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    groups: dict[int, WeightGroup] = {}
    joins = [threading.Thread(target=lambda r=r: groups.update({r: WeightGroup("127.0.0.1", port, r, 2, timeout_s=60)})) for r in (0, 1)]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    got: dict[str, dict[str, torch.Tensor]] = {}
    receiver = threading.Thread(target=lambda: got.update(r=groups[1].receive(specs_of(tensors), bucket_bytes)))
    receiver.start()
    groups[0].send(tensors, bucket_bytes)
    receiver.join()
    assert list(got["r"]) == list(tensors)
    for name, sent in tensors.items():
        assert got["r"][name].dtype == sent.dtype and torch.equal(got["r"][name], sent)
    with pytest.raises(RuntimeError, match="only rank 0"):
        groups[1].send(tensors)
    for group in groups.values():
        group.close()
