"""Time to first token with and without one image on the demo model (`openk3/assets/tiny` with its shipped vision tower and
processor settings), or with `--random-tower` on its text weights with a random K3-shaped tower and K3's processor (a
cost figure), engine side, same run, interleaved.

Rows, each the median over `--rounds` interleaved rounds (one greedy token, prefix caching off, a fresh engine state):
- text: a prompt of `--text` random tokens;
- text + image: the same text with one `--size` x `--size` image (its marker and media tokens), the encoder cache empty;
- text + image, encoder cache hit: the same, with the image's embeddings already cached (the encoder does not run);
- text of the same length: a text prompt as long as the image prompt (the prefill cost of the image's tokens alone).
The image is decoded and processed once per round before the clock starts; that time is its own row. Ratios are against
the text row of the same run. The shipped tower takes any square picture as 8 x 8 patches (16 media tokens); the random
tower is K3's shape scaled down (`--width`, `--layers`; 14-pixel patches, 2 x 2 merge, RMSNorm, patchmergerv2) with K3's
processor limits (448 x 448 = 256 media tokens), so its figures are costs, not answers.

    python benchmarks/vision_ttft.py                                   # the shipped demo tower
    python benchmarks/vision_ttft.py --random-tower --size 896 --rounds 5
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from openk3.config.vision import Projector, VisionConfig, VisionNorm
from openk3.launch.engine import build_engine
from openk3.launch.spec import EngineSpec
from openk3.model import K3ForCausalLM, load_model
from openk3.model.moe import DenseExperts
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.loading import ASSETS
from openk3.serve.media_prompt import ImageSpan, expand_media, media_pad_id
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from openk3.serve.vision_processor import ImageInput, MediaConfig, process_image, read_media_config

GREEDY = SamplingParams(temperature=0, max_tokens=1)


def demo_with_tower(width: int, layers: int) -> K3ForCausalLM:
    text = load_model(ASSETS / "tiny")
    assert isinstance(text, K3ForCausalLM)
    cfg = text.config
    heads = max(1, width // 64)
    vision = VisionConfig(
        width,
        layers,
        heads,
        4 * width,
        cfg.hidden_size,
        attn_bias=False,
        linear_bias=False,
        patch_embed_bias=False,
        norm=VisionNorm.RMSNORM,
        projector=Projector.PATCHMERGER_V2,
    )
    model = K3ForCausalLM(cfg, text.ops, vision)
    if text.moe_layers() and not isinstance(text.moe_layers()[0].experts, DenseExperts):
        model.quantize_experts()  # the demo checkpoint's experts are MXFP4: the same buffers, then the same names
    text_only = {k: v for k, v in text.state_dict().items() if not k.startswith(("vision_tower.", "mm_projector."))}  # the shipped tower is not this one
    missing = model.load_state_dict(text_only, strict=False).missing_keys
    assert all(k.startswith(("vision_tower.", "mm_projector.")) for k in missing), missing[:3]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("vision_tower.", "mm_projector.")):
                p.copy_(torch.ones_like(p) if "norm" in name else 0.02 * torch.randn(p.shape, generator=g))
    return model.eval()


def png(size: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def ttft(engine: LLMEngine, ids: list[int], spans: tuple[ImageSpan, ...], name: str) -> float:
    start = time.perf_counter()
    engine.add_request(name, ids, GREEDY, images=spans)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=448, help="image side in pixels")
    ap.add_argument("--text", type=int, default=64, help="text tokens of the prompt")
    ap.add_argument("--width", type=int, default=256, help="the tower's width (K3: 1024)")
    ap.add_argument("--layers", type=int, default=4, help="the tower's blocks (K3: 27)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--folder", default=str(ASSETS / "tiny"), help="the demo folder (with its vision tower)")
    ap.add_argument("--random-tower", action="store_true", help="the text weights with a random K3-shaped tower (--width, --layers)")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = EngineConfig(max_model_len=4096, max_num_seqs=1, max_num_batched_tokens=4096, pack_cpu_weights=True)
    if args.random_tower:
        model = demo_with_tower(args.width, args.layers)
        pad = model.config.vocab_size - 1  # the placeholder id of this benchmark (its rows are replaced by the image)
        engine = build_engine(EngineSpec(model, config, tokenizer=ByteTokenizer(model.config.vocab_size))).local  # the serving layout
        media = MediaConfig()
        tower = f"demo text model + random tower (width {args.width}, {args.layers} blocks)"
    else:
        engine = build_engine(EngineSpec(args.folder, config)).local  # as `openk3 serve` loads it
        found = media_pad_id(engine.tokenizer)
        shipped = read_media_config(Path(args.folder))
        assert found is not None and shipped is not None, "the demo folder has no vision tower"
        pad, media = found, shipped
        vision = engine.vision
        assert vision is not None
        tower = f"demo model with its shipped tower (width {vision.hidden_size}, {vision.num_hidden_layers} blocks)"
    assert engine.encoder_cache is not None
    rng = np.random.default_rng(1)
    text = [int(t) for t in rng.integers(300, 4090, args.text)]
    times: dict[str, list[float]] = {name: [] for name in ("text", "text + image", "text + image, encoder cache hit", "text of the same length", "processor")}
    n_image = 0
    for r in range(args.rounds + 1):  # round 0 warms up
        data = png(args.size, r)
        t0 = time.perf_counter()
        image: ImageInput = process_image(data, media)
        processed = time.perf_counter() - t0
        ids, spans = expand_media(text[:8] + [pad] + text[8:], pad, [image])
        n_image = image.num_tokens
        same_length = [int(t) for t in rng.integers(300, 4090, len(ids))]
        engine.encoder_cache.clear()
        got = {
            "text": ttft(engine, text, (), f"t{r}"),
            "text + image": ttft(engine, ids, spans, f"i{r}"),
            "text + image, encoder cache hit": ttft(engine, ids, spans, f"h{r}"),
            "text of the same length": ttft(engine, same_length, (), f"s{r}"),
            "processor": processed,
        }
        if r:
            for name, seconds in got.items():
                times[name].append(seconds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    where = platform.processor() or platform.machine()
    flags, threads = " ".join(sys.argv[1:]), torch.get_num_threads()
    print(f"command: python benchmarks/vision_ttft.py {flags}; commit {commit}; {where}, {os.cpu_count()} CPUs, torch threads {threads}")
    print(f"{tower}; one {args.size}x{args.size} image = {n_image} tokens; {args.text} text tokens\n")
    base = statistics.median(times["text"])
    print("| prompt | TTFT ms (median) | vs text |")
    print("|---|---|---|")
    for name, values in times.items():
        mid = statistics.median(values)
        print(f"| {name} | {mid * 1000:.1f} | {mid / base:.2f}x |")


if __name__ == "__main__":
    main()
