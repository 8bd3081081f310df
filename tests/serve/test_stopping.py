"""The stop rules alone (serve/stopping.py), token by token: their order, and the text cut by a stop string that began in
text already reported."""

from openk3.serve.request import Request, RequestStatus
from openk3.serve.sampling import SamplingParams
from openk3.serve.stopping import RequestText, token_stop
from openk3.serve.tokenizer import ByteTokenizer

EOS = 257


def feed(text: RequestText, req: Request, data: bytes, max_model_len: int = 100) -> list[tuple[str, int, str | None, RequestStatus | None]]:
    """Append each byte as a sampled token; what each one reported, up to the one that ended the request."""
    seen = []
    for b in data:
        req.append_output(b)
        status = token_stop(req, b, max_model_len, EOS)
        new = text.add(b, status, req.num_output_tokens)
        seen.append((new.text, new.dropped, new.stop, status))
        if status is not None or new.stop is not None:
            break
    return seen


def test_a_stop_string_that_began_in_reported_text_drops_it() -> None:
    params = SamplingParams(temperature=0, stop=("STOP",), max_tokens=50)
    req = Request("r", [1], params, eos_token_id=EOS)
    seen = feed(RequestText(ByteTokenizer(), [1], params), req, b"abST" + b"OP tail")
    assert [s[0] for s in seen[:-1]] == ["a", "b", "S", "T", "O"]
    assert seen[-1] == ("", 3, "STOP", None)  # "STO" were reported: drop them, add nothing


def test_include_stop_str_keeps_it_and_drops_nothing() -> None:
    params = SamplingParams(temperature=0, stop=("ST",), include_stop_str_in_output=True, max_tokens=50)
    req = Request("r", [1], params, eos_token_id=EOS)
    seen = feed(RequestText(ByteTokenizer(), [1], params), req, b"xST")
    assert seen[-1] == ("T", 0, "ST", None)


def test_length_comes_first_and_a_stop_string_on_the_same_token_is_still_found() -> None:
    params = SamplingParams(temperature=0, stop=("b",), max_tokens=2)
    req = Request("r", [1], params, eos_token_id=EOS)
    seen = feed(RequestText(ByteTokenizer(), [1], params), req, b"ab")
    assert seen[-1] == ("", 0, "b", RequestStatus.FINISHED_LENGTH)  # the engine lets the stop string win


def test_stop_tokens_wait_for_min_tokens_and_leave_their_text_out() -> None:
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(ord("!"),), max_tokens=50)
    req = Request("r", [1], params, eos_token_id=EOS)
    seen = feed(RequestText(ByteTokenizer(), [1], params), req, b"!a!")
    assert [s[3] for s in seen] == [None, None, RequestStatus.FINISHED_STOPPED]
    assert [s[0] for s in seen] == ["!", "a", ""] and req.stop_reason == ord("!")


def test_eos_is_no_stop_reason_and_ignore_eos_ignores_it() -> None:
    for ignore, want in ((False, RequestStatus.FINISHED_STOPPED), (True, None)):
        params = SamplingParams(temperature=0, ignore_eos=ignore, max_tokens=50)
        req = Request("r", [1], params, eos_token_id=EOS)
        req.append_output(EOS)
        assert token_stop(req, EOS, 100, EOS) is want
        assert req.stop_reason is None
