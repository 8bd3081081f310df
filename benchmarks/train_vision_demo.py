"""Train the demo model's vision tower (issue 38 item 5): a small MoonViT tower and projector for the `tiny` text model, on
synthetic pictures (openk3/train/shapes.py), so that the served demo captions a picture ("two red circles").

The vocabulary grows from 4096 to 4100 ids for K3's four media tokens (their lm_head rows copy the never-trained
`<|im_start|>` row). Each example is the exact prompt `openk3 serve` builds for a chat turn of one picture and one question
(K3's encoding; `--reply` picks thinking on with K3's whole reply, or thinking off with ` CAPTION<|eos|>`), and the loss is
the cross-entropy of the reply's tokens. Two stages, because backpropagating through the text model is what costs:
1. through the text model (fp32, experts dequantised from MXFP4): a factorised soft prompt for the image's 16 positions
   (Codes), the three new marker embeddings and, with `--head-rows`, the lm_head rows of the reply's tokens; every other
   text weight frozen (and exported unchanged, the MXFP4 experts bit for bit);
2. without the text model: the tower and projector regress each picture's soft prompt on fresh pictures.
The held-out table greedy-decodes fresh pictures through the engine from the exported folder (bf16, MXFP4 experts: what
`openk3 serve` loads); `--kjv` adds the text card's KJV held-out loss before and after.

    mkdir -p runs/tiny_text && git archive ce8345b openk3/assets/tiny | tar -x -C runs/tiny_text --strip-components 3
    python benchmarks/train_vision_demo.py --source runs/tiny_text --out runs/vd_a --head-rows --kjv --kjv-weight 1 \
        --code-minutes 12 --tower-minutes 8                          # from scratch
    python benchmarks/train_vision_demo.py --source runs/tiny_text --out runs/vd_b --init runs/vd_a/model --head-rows --kjv \
        --kjv-weight 1 --code-minutes 14 --tower-minutes 10          # continued: shipped
    cp runs/vd_b/model/* openk3/assets/tiny/
    python benchmarks/train_vision_demo.py --eval-only openk3/assets/tiny --source runs/tiny_text --kjv   # the card's table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from openk3.api.chat import ChatOptions
from openk3.api.chat_k3 import K3Template
from openk3.api.protocol import ChatMessage
from openk3.api.user_text import encode_prompt_text
from openk3.config.vision import Projector, VisionConfig, VisionNorm
from openk3.llm import LLM
from openk3.model import K3ForCausalLM, load_model
from openk3.model.batch import ForwardBatch
from openk3.model.moe import DenseExperts, PackedExperts
from openk3.ops.mxfp4 import dequantize
from openk3.ops.registry import OpTarget
from openk3.serve.media_prompt import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, ImageSpan, expand_media
from openk3.serve.tokenizer import HFTokenizer, Tokenizer
from openk3.serve.vision_processor import MediaConfig, process_image
from openk3.train.shapes import COLOURS, COUNTS, KINDS, QUESTIONS, Picture, pictures

MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD)
REPLIES = {  # --reply -> (thinking on, the reply after the generation prompt)
    # the default prompt (thinking on) and K3's whole reply
    "k3": (True, "<|close|>think<|sep|><|open|>response<|sep|>{answer}<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"),
    # thinking off (the prompt then opens the response block itself): the caption, then the end of sequence
    "caption": (False, " {answer}<|eos|>"),
}
# the demo's processor: any square picture becomes 8 x 8 patches of 14 pixels (16 media tokens after the 2 x 2 merge)
MEDIA = MediaConfig(patch_size=14, merge_kernel_size=2, in_patch_limit=64, patch_limit_on_one_side=8)
EPS = 1e-5  # the projector post-norm's epsilon (VisionConfig.projector_ln_eps)
PAD_ID = 2  # <|pad|>: fills a batch's shorter rows after their reply (never a target)


def tower_config(width: int, layers: int, text_hidden: int) -> VisionConfig:
    """K3's switches (RMSNorm, no biases, patchmergerv2), scaled down; the position table is the 8 x 8 grid it sees."""
    return VisionConfig(
        width, layers, max(1, width // 32), 4 * width, text_hidden, pos_emb_height=8, pos_emb_width=8,
        attn_bias=False, linear_bias=False, patch_embed_bias=False, norm=VisionNorm.RMSNORM, projector=Projector.PATCHMERGER_V2,
    )  # fmt: skip


def with_media_tokens(folder: Path, out: Path) -> None:
    """Copy the text model's tokenizer files to `out` with the four media tokens added as specials (ids 4096-4099)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(folder / name, out / name)
    spec = json.loads((folder / "tokenizer.json").read_text())
    have = {t["content"] for t in spec["added_tokens"]}
    base = len(spec["model"]["vocab"])
    for i, name in enumerate(t for t in MEDIA_TOKENS if t not in have):
        spec["added_tokens"].append(
            {"id": base + i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        )
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))


def dense_text_model(folder: Path, vocab: int, vision: VisionConfig) -> K3ForCausalLM:
    """The text model in fp32 with dense (dequantised MXFP4) experts, its vocabulary grown to `vocab` (new embedding rows and
    lm_head rows copy id 3, `<|im_start|>`, which training never saw), and a fresh tower beside it."""
    text = load_model(folder, dtype=torch.float32)
    model = K3ForCausalLM(text.config.replace(vocab_size=vocab, expert_quantization=None), dataclasses.replace(text.ops, packed_experts=False), vision)
    model.init_weights(seed=0)
    state = {}
    for name, t in text.state_dict().items():
        state[name] = t
    for moe, src in zip(model.moe_layers(), text.moe_layers(), strict=True):
        assert isinstance(src.experts, PackedExperts) and isinstance(moe.experts, DenseExperts)
        for w in ("w1", "w3", "w2"):
            packed, scale = getattr(src.experts, f"{w}_weight_packed"), getattr(src.experts, f"{w}_weight_scale")
            prefix = f"model.layers.{moe.layer_index}.block_sparse_moe.experts."
            state.pop(prefix + f"{w}_weight_packed"), state.pop(prefix + f"{w}_weight_scale")
            state[prefix + w] = dequantize(packed, scale, torch.float32)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        old = state[name]
        state[name] = torch.cat([old, old[3:4].expand(vocab - old.shape[0], -1)])
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all(k.startswith(("vision_tower.", "mm_projector.")) for k in missing), missing[:3]
    return model


def example(tok: Tokenizer, template: K3Template, pic: Picture, question: str, mode: str, reply: bool) -> tuple[list[int], int, tuple[ImageSpan, ...]]:
    """The prompt `openk3 serve` builds for one image and one question (media tokens expanded) in REPLIES[mode]'s thinking
    mode, with that reply appended when `reply`; where the reply starts; the image's span."""
    image = process_image(pic.png, MEDIA)
    msg = ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": question}]})
    options = ChatOptions(image_sizes=((image.width, image.height),))
    thinking, text = REPLIES[mode]
    prompt = template.render_prompt([msg], True, None, {"thinking": thinking}, None, tok.special_token_strings, options)
    pad = tok.encode(MEDIA_PAD)[0]
    ids, spans = expand_media(encode_prompt_text(tok, prompt), pad, [image])
    start = len(ids)
    if reply:
        ids += tok.encode(text.format(answer=pic.caption))
    return ids, start, spans


def batch_loss(model: K3ForCausalLM, rows: list[tuple[list[int], int, tuple[ImageSpan, ...]]], pad_id: int, embeds: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Mean cross-entropy of the replies' tokens, and the fraction of them the model predicts exactly (teacher forced)."""
    length = max(len(ids) for ids, _, _ in rows)
    ids_BL = torch.full((len(rows), length), PAD_ID, dtype=torch.int64)
    targets = torch.full((len(rows), length), -100, dtype=torch.int64)
    mm_rows = []
    for b, (ids, start, _) in enumerate(rows):
        ids_BL[b, : len(ids)] = torch.tensor(ids)
        targets[b, start - 1 : len(ids) - 1] = torch.tensor(ids[start:])
        mm_rows += [b * length + i for i, t in enumerate(ids) if t == pad_id]
    batch = ForwardBatch.from_tokens(ids_BL)
    batch = ForwardBatch(batch.input_ids, batch.positions, batch.cu_seqlens, batch.context_lens, mm_embeds=embeds, mm_rows=torch.tensor(mm_rows))
    logits = model(batch).view(len(rows), length, -1)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    mask = targets != -100
    return loss, float((logits.argmax(-1)[mask] == targets[mask]).float().mean())


def export(model: K3ForCausalLM, source: Path, out: Path) -> None:
    """The text model's files with the trained embedding and lm_head rows (the others as shipped), plus the tower and
    projector (bf16), the multimodal config.json and the demo's preprocessor_config.json."""
    from safetensors.torch import load_file, save_file

    from openk3.config.hf import save_config

    with_media_tokens(source, out)
    tensors = load_file(str(source / "model.safetensors"))
    state = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # the trained rows; the others are the shipped values
        tensors[name] = state[name].to(tensors[name].dtype).contiguous()
    for name, t in state.items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            tensors[name] = t.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert model.vision is not None
    save_config(model.config.replace(expert_quantization="mxfp4"), out / "config.json", model.vision)
    cfg = {"media_proc_cfg": {"patch_size": MEDIA.patch_size, "merge_kernel_size": MEDIA.merge_kernel_size, "in_patch_limit": MEDIA.in_patch_limit,
           "patch_limit_on_one_side": MEDIA.patch_limit_on_one_side, "image_mean": list(MEDIA.image_mean), "image_std": list(MEDIA.image_std)}}  # fmt: skip
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def reply_answer(text: str) -> str:
    """The answer inside K3's reply (what the server's parsers return as the message content)."""
    head, _, rest = text.partition("<|open|>response<|sep|>")
    return rest.partition("<|close|>response")[0].strip() if rest else head.strip()


def ask(llm: LLM, template: K3Template, questions: list[tuple[Picture, str]], mode: str) -> list[str]:
    """The greedy answers of `llm` to each (picture, question), the prompts built as `openk3 serve` builds them, batched."""
    from openk3.serve.output import OutputKind
    from openk3.serve.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=40, stop=("<|end_of_msg|>",), skip_special_tokens=False)
    for i, (pic, q) in enumerate(questions):
        ids, _, spans = example(llm.tokenizer, template, pic, q, mode, False)
        llm.processor.add_request(str(i), ids, params, OutputKind.FINAL_ONLY, images=spans)
    done = {}
    while llm.core.has_unfinished():
        for out in llm.processor.process(llm.core.step()):
            done[out.request_id] = out.text
    return [reply_answer(done[str(i)]) for i in range(len(questions))]


def held_out(folder: Path, seed: int, n: int, mode: str) -> dict[str, int]:
    """Every question about `n` fresh pictures, answered by the folder as `openk3 serve` loads it (bf16, MXFP4 experts):
    counts of replies that are the exact caption and that name the right colour, kind and count."""
    llm = LLM(str(folder), max_num_seqs=32, max_model_len=1024)
    try:
        questions = [(pic, q) for pic in pictures(seed, n) for q in QUESTIONS]
        answers = ask(llm, K3Template("demo"), questions, mode)
    finally:
        llm.close()
    score = dict.fromkeys(("asked", "caption", "colour", "kind", "count"), 0)
    for (pic, _), got in zip(questions, answers, strict=True):
        words = got.split()
        score["asked"] += 1
        score["caption"] += got == pic.caption
        score["colour"] += pic.colour in words
        score["kind"] += any(w.rstrip("s") == pic.kind for w in words)
        score["count"] += COUNTS[pic.count - 1] in words
    return score


def kjv_held_out_loss(folder: Path) -> float:
    """The text model card's held-out figure for a folder: next-token loss over every 256-token window of the KJV chapters
    it held out (openk3/train/data.py), as the card's "exported folder" row measures it (load_model, MXFP4 experts)."""
    from openk3.train.data import encode_documents, eval_windows, kjv_chapters, split_documents
    from openk3.train.trainer import evaluate

    model = load_model(folder)
    tok = HFTokenizer(folder)
    eos = tok.eos_token_id
    assert eos is not None
    _, held = split_documents(kjv_chapters())
    with torch.no_grad():
        return evaluate(model, eval_windows(encode_documents(tok._tok, held, eos), 256))


class Codes(torch.nn.Module):
    """Stage 1's soft prompt: for a picture of colour c, kind k and count n, the image's 16 embeddings are
    RMSNorm(base + colour[c] + kind[k] + count[n]) with the projector's own post-norm form and weight."""

    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.Parameter(torch.randn(tokens, width, generator=g))
        self.parts = torch.nn.ParameterDict(
            {
                name: torch.nn.Parameter(0.5 * torch.randn(len(values), tokens, width, generator=g))
                for name, values in (("colour", COLOURS), ("kind", KINDS), ("count", COUNTS))
            }
        )
        self.weight = torch.nn.Parameter(torch.full((width,), 0.03))

    def forward(self, pics: list[Picture]) -> torch.Tensor:
        rows = [
            self.base + self.parts["colour"][list(COLOURS).index(p.colour)] + self.parts["kind"][KINDS.index(p.kind)] + self.parts["count"][p.count - 1]
            for p in pics
        ]
        return F.rms_norm(torch.cat(rows), self.weight.shape, self.weight, EPS)


@torch.no_grad()
def kjv_states(model: K3ForCausalLM, tok: Tokenizer, windows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The text model's final hidden states on the first `windows` 256-token windows of its KJV *training* chapters, and the
    next tokens: they do not depend on anything stage 1 trains but the lm_head, so the text loss as a function of the
    lm_head costs one matmul a step."""
    from openk3.train.data import encode_documents, eval_windows, kjv_chapters, split_documents

    assert isinstance(tok, HFTokenizer) and tok.eos_token_id is not None
    train_docs, _ = split_documents(kjv_chapters())
    w = eval_windows(encode_documents(tok._tok, train_docs, tok.eos_token_id), 256, windows)
    h = model.model(ForwardBatch.from_tokens(w[:, :-1]), None)
    return h.detach(), w[:, 1:].reshape(-1)


def learn_codes(model: K3ForCausalLM, tok: Tokenizer, args: argparse.Namespace, log) -> Codes:
    """Stage 1: the codes and the media markers' embeddings, through the frozen text model, until `--code-minutes`."""
    template, pad = K3Template("demo"), tok.encode(MEDIA_PAD)[0]
    codes = Codes(16, model.config.hidden_size)
    if args.init is not None:  # continue from a run's codes.pt (its folder's weights were loaded by train())
        codes.load_state_dict(torch.load(args.init.parent / "codes.pt"))
    emb = model.model.embed_tokens.weight
    emb.requires_grad_(True)
    keep = torch.zeros(emb.shape[0], 1)
    keep[tok.vocab_size - 4 :] = 1.0
    emb.register_hook(lambda g: g * keep)  # only the media tokens' rows learn
    parts = [codes.base, *codes.parts.values()]
    groups = [{"params": parts, "lr": args.lr}, {"params": [codes.weight, emb], "lr": args.lr * 0.1}]  # both ~0.03 in size
    if args.head_rows:  # the lm_head rows of the caption's tokens and <|eos|> learn too (every other row stays)
        head = model.lm_head.weight
        head.requires_grad_(True)
        words = {t for pic in pictures(args.seed, 200) for t in tok.encode(REPLIES[args.reply][1].format(answer=pic.caption))}
        head_keep = torch.zeros(head.shape[0], 1)
        head_keep[sorted(words)] = 1.0
        head.register_hook(lambda g: g * head_keep)
        groups.append({"params": [head], "lr": args.lr * 0.1})
        print(f"lm_head rows trained: {sorted(words)}", flush=True)
        kjv_h, kjv_y = kjv_states(model, tok)
    opt = torch.optim.Adam(groups)
    pics, qs = pictures(args.seed, 100_000 // 64), list(QUESTIONS)
    spent, step = 0.0, 0
    while spent < args.code_minutes * 60:
        t0 = time.perf_counter()
        batch = [pics[(step * args.batch_size + j) % len(pics)] for j in range(args.batch_size)]
        rows = [example(tok, template, pic, qs[(step + j) % len(qs)], args.reply, True) for j, pic in enumerate(batch)]
        loss, acc = batch_loss(model, rows, pad, codes(batch))
        total = loss
        if args.head_rows:  # the text model's own loss on KJV text, kept: its lm_head rows may move only where it costs nothing
            kjv = F.cross_entropy(model.lm_head(kjv_h), kjv_y)
            total = loss + args.kjv_weight * kjv
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        spent += time.perf_counter() - t0
        step += 1
        log.write(json.dumps({"stage": 1, "step": step, "loss": round(loss.item(), 4), "reply_token_acc": round(acc, 4), "seconds": round(spent, 1)}) + "\n")
        log.flush()
        print(f"codes step {step} loss {loss.item():.4f} reply-token acc {acc:.3f} total {total.item():.4f} ({spent:.0f} s)", flush=True)
    emb.requires_grad_(False)
    return codes


def fit_tower(model: K3ForCausalLM, codes: Codes, args: argparse.Namespace, log) -> None:
    """Stage 2: the tower and projector regress each picture's code (mean squared error of the embeddings, the projector's
    post-norm weight set to the codes' and kept), on fresh pictures, until `--tower-minutes`."""
    model.mm_projector.post_norm.weight.data.copy_(codes.weight.detach())
    params = [p for n, p in model.named_parameters() if n.startswith(("vision_tower.", "mm_projector.")) and n != "mm_projector.post_norm.weight"]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.tower_lr, weight_decay=0.01)
    rng_seed, spent, step = args.seed + 1, 0.0, 0
    scale = 1.0 / codes.weight.detach().pow(2).mean()
    while spent < args.tower_minutes * 60:
        t0 = time.perf_counter()
        batch = pictures(rng_seed * 1_000_003 + step, 32)
        images = [process_image(p.png, MEDIA) for p in batch]
        with torch.no_grad():
            want = codes(batch)
        got = model.encode_images(torch.cat([im.pixels for im in images]), [im.grid for im in images])
        loss = F.mse_loss(got, want) * scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        spent += time.perf_counter() - t0
        step += 1
        log.write(json.dumps({"stage": 2, "step": step, "loss": round(loss.item(), 5), "seconds": round(spent, 1)}) + "\n")
        if step % 20 == 0:
            print(f"tower step {step} relative mse {loss.item():.5f} ({spent:.0f} s)", flush=True)


def train(args: argparse.Namespace) -> K3ForCausalLM:
    """Both stages; one line per step in OUT/log.jsonl."""
    source = Path(args.source)
    tok_dir = args.out / "tokenizer"
    with_media_tokens(source, tok_dir)
    tok = HFTokenizer(tok_dir)
    raw = json.loads((source / "config.json").read_text())
    if "vision_config" in raw:
        raise SystemExit(f"--source {source} already has a vision tower: pass the text-only folder (the module docstring says how)")
    text_hidden = raw["hidden_size"]
    model = dense_text_model(source, tok.vocab_size, tower_config(args.width, args.layers, text_hidden))
    if args.init is not None:  # a previous run's trained rows, tower and projector (its export), to continue from
        from safetensors.torch import load_file

        done = load_file(str(args.init / "model.safetensors"))
        state = model.state_dict()
        for name in ("model.embed_tokens.weight", "lm_head.weight", *[k for k in state if k.startswith(("vision_tower.", "mm_projector."))]):
            state[name].copy_(done[name].float())
    model.select_ops(target=OpTarget(training=True))
    for p in model.parameters():
        p.requires_grad_(False)
    with (args.out / "log.jsonl").open("w") as log:
        codes = learn_codes(model, tok, args, log)
        torch.save(codes.state_dict(), args.out / "codes.pt")
        fit_tower(model, codes, args, log)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help="the text-only demo folder (before the tower: git archive ce8345b openk3/assets/tiny)")
    ap.add_argument("--out", type=Path, default=Path("runs/vision_demo"))
    ap.add_argument("--code-minutes", type=float, default=13.0, help="stage 1's step time (through the frozen text model)")
    ap.add_argument("--tower-minutes", type=float, default=4.0, help="stage 2's step time (the tower alone)")
    ap.add_argument("--batch-size", type=int, default=2, help="stage 1's rows per step")
    ap.add_argument("--lr", type=float, default=0.1, help="stage 1 Adam lr of the soft prompt (a tenth for the rows and the norm weight)")
    ap.add_argument("--tower-lr", type=float, default=3e-3)
    ap.add_argument("--init", type=Path, default=None, help="continue from a run's exported folder (and the codes.pt beside it)")
    ap.add_argument("--kjv-weight", type=float, default=1.0, help="weight of the KJV loss that keeps the trained lm_head rows honest")
    ap.add_argument("--head-rows", action="store_true", help="also train the lm_head rows of the reply's tokens (changes the text model)")
    ap.add_argument("--reply", choices=sorted(REPLIES), default="caption", help="the prompt and reply format trained (REPLIES)")
    ap.add_argument("--width", type=int, default=64, help="the tower's width")
    ap.add_argument("--layers", type=int, default=2, help="the tower's blocks")
    ap.add_argument("--seed", type=int, default=0, help="training pictures' seed (held-out pictures use 1000 + seed)")
    ap.add_argument("--held-out", type=int, default=50, help="fresh pictures for the held-out table (4 questions each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core machine)")
    ap.add_argument("--eval-only", type=Path, default=None, help="skip training: the held-out table of this folder")
    ap.add_argument("--kjv", action="store_true", help="also the KJV held-out loss of --source and of the folder (the text card's figure)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder = args.eval_only
    if folder is None:
        model = train(args)
        folder = args.out / "model"
        export(model, Path(args.source), folder)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    score = held_out(folder, 1000 + args.seed, args.held_out, args.reply)
    print(f"\ncommand: python benchmarks/train_vision_demo.py {' '.join(sys.argv[1:])}; commit {commit}; {platform.machine()}")
    print(f"held-out: {args.held_out} fresh pictures (seed {1000 + args.seed}), each asked the {len(QUESTIONS)} questions; greedy replies\n")
    print("| reply | count | fraction |")
    print("|---|---|---|")
    total = score["asked"]
    for key, what in (
        ("caption", "the exact caption"),
        ("colour", "names the right colour"),
        ("kind", "names the right shape"),
        ("count", "names the right count"),
    ):
        print(f"| {what} | {score[key]}/{total} | {score[key] / total:.0%} |")
    if args.kjv:
        before, after = kjv_held_out_loss(Path(args.source)), kjv_held_out_loss(folder)
        print(f"\nKJV held-out loss (nats/token, all windows of 256): text model {before:.4f}, with the tower {after:.4f}")


if __name__ == "__main__":
    main()
