"""cache_salt (vLLM's) in the prefix-cache key: requests with different salts never share a cached prefix, on the device or in
a lower tier; requests with the same salt do; requests without one behave as before."""

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.cache.hashing import request_salt
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.prefix_types import PrefixCacheConfig
from openk3.serve.cache.tier_types import TierKind
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

A = list(range(100, 110))  # 10 tokens: two full pages of 4 and a tail of 2
SHORT = [5, 6, 7]  # shorter than a page: its snapshot hangs on the root itself


def manager(snapshots: int = 4, host_bytes: int = 0) -> CacheManager:
    cfg = PrefixCacheConfig(num_snapshot_slots=snapshots, salt=b"test", host_bytes=host_bytes)
    return CacheManager(debug(), num_pages=16, page_size=4, num_slots=2, prefix=cfg)


def cache(cm: CacheManager, req: str, tokens: list[int], salt: str | None) -> None:
    match = cm.fetch(cm.match_prefix(tokens, salt))
    assert cm.allocate_prefixed(req, tokens, match, len(tokens), salt)
    assert cm.snapshot(req, tokens, salt)
    cm.free(req)


def hit(cm: CacheManager, tokens: list[int], salt: str | None) -> int:
    return cm.match_prefix(tokens + [1], salt).num_tokens


def test_salts_key_separate_trees() -> None:
    assert request_salt(b"m", None) == b"m"
    assert len({request_salt(b"m", "x"), request_salt(b"m", "y"), request_salt(b"n", "x"), b"m"}) == 4
    cm = manager()
    cache(cm, "a", A, None)
    cache(cm, "s", SHORT, "alice")
    assert (hit(cm, A, None), hit(cm, A, "alice"), hit(cm, A, "bob")) == (10, 0, 0)  # unsalted: as before; salted: a miss
    assert (hit(cm, SHORT, "alice"), hit(cm, SHORT, "bob"), hit(cm, SHORT, None)) == (3, 0, 0)  # a root snapshot too
    assert cm.match_prefix(A[:6] + [9, 9], "alice").matched_tokens == 0  # no token-level match leaks across salts either
    cache(cm, "b", A, "alice")
    assert (hit(cm, A, None), hit(cm, A, "alice"), hit(cm, A, "bob")) == (10, 10, 0)
    cm.check_integrity()
    prefix = cm.prefix
    assert prefix is not None
    # the same tokens under two salts are two copies: their own pages and their own state slots
    assert sorted(prefix.snapshot_boundaries()) == [3, 10, 10] and prefix.num_snapshots == 3
    prefix.clear()  # evicting a salted tree's last snapshot drops its root
    assert not prefix._salted
    cm.check_integrity()
    assert cm.num_free_pages == 16


def test_salted_prefix_offloaded_to_host_is_hit_only_with_its_salt() -> None:
    cm = manager(snapshots=1, host_bytes=64 * 2**20)
    cache(cm, "a", A, "alice")
    cache(cm, "b", SHORT, None)  # takes the only device slot: alice's state goes to the host tier
    m = cm.match_prefix(A + [1], "alice")
    assert (m.num_tokens, m.tier) == (10, TierKind.HOST)
    assert hit(cm, A, "bob") == 0 and hit(cm, A, None) == 0
    cm.check_integrity()


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    m = K3ForCausalLM(debug())
    m.init_weights(seed=5)
    engine = LLM(m.eval(), ByteTokenizer(256), page_size=4, num_pages=64, max_num_seqs=2, enable_prefix_caching=True, prefix_match_unit=8)
    yield engine
    engine.close()


def test_engine_caches_per_salt(llm) -> None:
    """A finished prompt leaves a state at its end: the same prompt with more text hits it at 40 tokens, with its salt only."""
    prompt, more = list(range(40, 80)), [1, 2, 3]
    base = SamplingParams(temperature=0, max_tokens=3)

    def run(tokens: list[int], salt: str | None) -> tuple[list[int], int]:
        (out,) = llm.generate([list(tokens)], base.replace(cache_salt=salt))
        llm.engine.check_integrity()
        return list(out.token_ids), out.num_cached_tokens

    reply, n = run(prompt, None)
    assert n == 0
    longer, n = run(prompt + more, None)
    assert n == 40  # unsalted: as before
    assert run(prompt + more, "alice") == (longer, 0)  # a salt never hits what no salt (or another salt) cached
    assert run(prompt, "alice") == (reply, 0)
    assert run(prompt + more, "alice") == (longer, 40)  # the same salt does
    assert run(prompt + more, "bob") == (longer, 0)


def test_states_taken_inside_a_step_are_keyed_by_the_request_salt() -> None:
    cm = manager()
    match = cm.fetch(cm.match_prefix(A, "alice"))
    assert cm.allocate_prefixed("a", A, match, len(A), "alice")
    slot = cm.reserve_snapshot_slot()
    assert slot == 2
    assert cm.adopt_snapshot("a", A[:8], slot, "alice")  # the step wrote the state after 8 tokens there
    assert (hit(cm, A[:8], "alice"), hit(cm, A[:8], None), hit(cm, A[:8], "bob")) == (8, 0, 0)
    again = cm.reserve_snapshot_slot()
    assert again == 3 and not cm.adopt_snapshot("a", A[:8], again, "alice")  # cached already: the slot goes back
    cm.free("a")
    cm.check_integrity()
    prefix = cm.prefix
    assert prefix is not None and prefix.snapshot_boundaries() == [8] and set(prefix._salted) == {request_salt(b"test", "alice")}
