"""Weight-update time vs model size: what it costs to put a trainer's new weights into a live openk3 engine.

For three sizes of K3-architecture model (the `debug` preset, the `tiny` demo shape, and `tiny` with 32 layers), fp32:
- load: `update_engine_weights` of a full state dict into an idle engine (check names and shapes, copy in place, re-apply
  the serving layout, rekey the prefix cache) -- the part done while the engine is paused;
- load + quantise: the same dense state dict into an engine that serves MXFP4 experts (every expert quantised on the way in);
- read folder: reading the safetensors folder a trainer wrote (what /update_weights_from_disk does before pausing);
- gloo: broadcasting the state dict over a WeightGroup from a trainer thread to a receiver thread of this process (what
  /update_weights_from_distributed does before pausing), over loopback TCP: one broadcast per tensor (the baseline) and
  bucketed (flat buffers of one dtype up to 64 MiB, the default), interleaved.
Correctness gate: after each load the engine's weights equal the state dict (every tensor, exactly; for MXFP4 the packed
bytes equal offline quantisation), else the row says FAIL. Median of --repeats, the paths interleaved per repeat.

  python benchmarks/weight_update.py
  python benchmarks/weight_update.py --repeats 1 --sizes debug tiny
"""

from __future__ import annotations

import argparse
import copy
import platform
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from openk3.config import ModelConfig, debug, tiny
from openk3.config.presets import k3_schedule
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.checkpoint import iter_checkpoint
from openk3.model.weights import save_model
from openk3.parallel.weight_group import BUCKET_BYTES, WeightGroup, specs_of
from openk3.parallel.weight_update import update_engine_weights
from openk3.serve.tokenizer import ByteTokenizer

SIZES = {
    "debug": debug,
    "tiny": tiny,
    "tiny-32L": lambda: tiny().replace(name="tiny-32L", num_hidden_layers=32, mla_layers=k3_schedule(32)),
}


def model(config: ModelConfig, seed: int) -> K3ForCausalLM:
    m = K3ForCausalLM(config)
    m.init_weights(seed=seed)
    return m.eval()


def engine(m: K3ForCausalLM) -> LLM:
    return LLM(m, ByteTokenizer(max(256, m.config.vocab_size)), page_size=16, num_pages=16, max_num_seqs=2, max_model_len=128)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gloo_transfer(state: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[float, bool]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    groups: dict[int, WeightGroup] = {}
    joins = [threading.Thread(target=lambda r=r: groups.update({r: WeightGroup("127.0.0.1", port, r, 2, timeout_s=120)})) for r in (0, 1)]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    got: dict[str, dict[str, torch.Tensor]] = {}
    t0 = time.perf_counter()
    receiver = threading.Thread(target=lambda: got.update(r=groups[1].receive(specs_of(state), bucket_bytes)))
    receiver.start()
    groups[0].send(state, bucket_bytes)
    receiver.join()
    seconds = time.perf_counter() - t0
    ok = all(torch.equal(got["r"][k], v) for k, v in state.items())
    for g in groups.values():
        g.close()
    return seconds, ok


def row(name: str, repeats: int) -> str:
    config = SIZES[name]()
    new = model(config, 2)
    state = {k: v.clone() for k, v in new.state_dict().items()}
    params = sum(v.numel() for v in state.values())
    mb = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
    dense = model(config, 1)
    dense_llm = engine(dense)
    packed = model(config, 1)
    packed.quantize_experts()
    packed_llm = engine(packed)
    offline = copy.deepcopy(new)
    offline.quantize_experts()
    want_packed = {k: v for k, v in offline.state_dict().items() if k.endswith(("_weight_packed", "_weight_scale"))}
    times: dict[str, list[float]] = {"load": [], "quant": [], "read": [], "gloo": [], "gloo1": []}
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        save_model(new, folder)
        for _ in range(repeats):
            times["load"].append(timed(lambda: update_engine_weights(dense_llm.engine, state)))
            served = dict(dense.state_dict())  # the engine's module, laid out for serving
            ok &= all(torch.equal(served[k], v) for k, v in state.items())
            times["quant"].append(timed(lambda: update_engine_weights(packed_llm.engine, state)))
            served = dict(packed.state_dict())
            ok &= all(torch.equal(served[k], v) for k, v in want_packed.items())
            times["read"].append(timed(lambda: dict(iter_checkpoint(Path(folder)))))
            for key, bucket_bytes in (("gloo1", 0), ("gloo", BUCKET_BYTES)):
                seconds, same = gloo_transfer(state, bucket_bytes)
                times[key].append(seconds)
                ok &= same
    dense_llm.close()
    packed_llm.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    if not ok:
        return f"| {name} | {params / 1e6:.2f}M | {mb:.1f} | FAIL | FAIL | FAIL | FAIL | FAIL | - |"
    return (
        f"| {name} | {params / 1e6:.2f}M | {mb:.1f} | {med['load'] * 1e3:.0f} | {med['quant'] * 1e3:.0f} | {med['read'] * 1e3:.0f} "
        f"| {med['gloo1'] * 1e3:.0f} | {med['gloo'] * 1e3:.0f} ({mb / med['gloo']:.0f} MB/s) | {med['gloo1'] / med['gloo']:.1f}x |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/weight_update.py --sizes {' '.join(args.sizes)} --repeats {args.repeats} --threads {args.threads}")
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads; commit {commit}")
    print()
    print("| model | parameters | fp32 MB | load ms | load + MXFP4 quantise ms | read folder ms | gloo per tensor ms | gloo bucketed ms | bucketed speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.sizes:
        print(row(name, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
