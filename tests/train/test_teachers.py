"""Many teachers: the tokenizer check compares id -> token tables (a renamed copy passes, one changed id fails and is named),
thinking segments are masked as the markers bound them, and routed scoring gives each window its domain's teacher and each
thinking position the reasoning teacher, exactly as each teacher's own forward; the store round-trips and streams it."""

from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.tokenizer import ByteTokenizer
from openk3.train.teacher_store import StoreLayout, StoreWriter, TeacherStream, read_layout
from openk3.train.teachers import (
    TeacherRouting,
    ThinkingMarkers,
    TokenizerMismatch,
    check_same_tokenizer,
    score_routed,
    thinking_mask,
)
from openk3.train.tokenizer import train_tokenizer

ENGINE: dict[str, Any] = dict(max_num_seqs=8, max_model_len=64)


def test_tokenizer_check_compares_ids_not_names() -> None:
    texts = ["in the beginning god created the heaven and the earth"] * 20
    a, b = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
    assert check_same_tokenizer({"a": a, "b": b})  # two objects, the same table
    other = train_tokenizer(["def main(): return 0"] * 20, 300)
    with pytest.raises(TokenizerMismatch, match=r"'a' and 'other' do not share a tokenizer: .* id \d+"):
        check_same_tokenizer({"a": a, "other": other})


def test_thinking_mask_follows_the_markers() -> None:
    markers = ThinkingMarkers(open_ids=(7, 8), close_ids=(9,))
    tokens = torch.tensor([[1, 7, 8, 2, 3, 9, 4, 7, 8, 5], [8, 2, 9, 3, 4, 5, 6, 7, 1, 2]])
    # targets are tokens[:, 1:]; inside = after the open marker, through the close marker; open at the end runs on
    want = [[0, 0, 1, 1, 1, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert thinking_mask(tokens, markers).int().tolist() == want
    with pytest.raises(ValueError, match="needs the thinking markers"):
        TeacherRouting({"a": "t"}, reasoning="r")


def model(seed: int, hidden: int) -> K3ForCausalLM:
    m = K3ForCausalLM(debug().replace(hidden_size=hidden) if hidden != 64 else debug())
    m.init_weights(seed=seed)
    return m.eval()


def test_routed_scoring_and_the_store(tmp_path) -> None:
    # three teachers of two sizes sharing the byte tokenizer
    models = {"bible": model(1, 64), "code": model(2, 32), "reasoner": model(3, 64)}
    engines = {n: LLM(m, ByteTokenizer(256), **ENGINE) for n, m in models.items()}
    markers = ThinkingMarkers((200,), (201,))
    routing = TeacherRouting({"kjv": "bible", "python": "code"}, reasoning="reasoner", markers=markers)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 199, (4, 13), generator=g)
    windows[1, 3], windows[1, 8] = 200, 201  # a thinking segment in a kjv window: targets 3..7 (positions 3..7 of [:, 1:])
    domains = ["kjv", "kjv", "python", "kjv"]
    scored = score_routed(engines, routing, windows, domains, 256, ("kjv", "python"))
    names = routing.teachers()
    assert names == ("bible", "code", "reasoner")
    for w, d in enumerate(domains):
        with torch.no_grad():
            own = {n: m.forward_tokens(windows[w : w + 1, :-1])[0].log_softmax(-1) for n, m in models.items()}
        for t in range(12):
            who = "reasoner" if (w == 1 and 3 <= t <= 7) else routing.teacher_of(d)
            assert names[int(scored.teacher_WL[w, t])] == who
            got = torch.full((256,), float("nan")).scatter(0, scored.topk_ids_WLk[w, t], scored.topk_logprobs_WLk[w, t])
            torch.testing.assert_close(got, own[who][t], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="'math' has no teacher"):
        score_routed(engines, routing, windows[:1], ["math"], 4, ("math",))

    layout = StoreLayout(k=256, seq_len=12, tokenizer="fp", domains=("kjv", "python"), teachers=names)
    writer = StoreWriter(tmp_path / "store", layout, shard_windows=3)
    writer.add(scored)
    assert writer.close().shards == (("shard-00000.safetensors", 3), ("shard-00001.safetensors", 1))
    assert read_layout(tmp_path / "store").num_windows == 4
    stream = TeacherStream(tmp_path / "store", seed=3)
    seen = stream.next_batch(4)  # one epoch: every window once
    order = [int(torch.nonzero((windows == row).all(-1))[0]) for row in seen.tokens_WL1]
    assert sorted(order) == [0, 1, 2, 3]
    for i, w in enumerate(order):
        assert torch.equal(seen.topk_ids_WLk[i], scored.topk_ids_WLk[w]) and torch.equal(seen.teacher_WL[i], scored.teacher_WL[w])
        assert torch.equal(seen.topk_logprobs_WLk[i], scored.topk_logprobs_WLk[w]) and int(seen.domain_W[i]) == int(scored.domain_W[w])
    state = stream.state_dict()
    nxt = stream.next_batch(3)
    again = TeacherStream(tmp_path / "store", seed=3)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch(3).tokens_WL1, nxt.tokens_WL1)  # a resumed stream continues with the same windows
    with pytest.raises(FileExistsError):
        StoreWriter(tmp_path / "store", layout)
