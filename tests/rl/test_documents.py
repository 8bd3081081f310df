"""The task's document store: BM25 ranking against the formula worked out by hand on a fixture, deterministic ties,
pagination, the load-time checks of a store folder, and hostile ids / pages / k answered as tool errors (never a path,
never a crash)."""

import math
from pathlib import Path

import pytest

from openk3.rl.documents import MAX_K, Document, DocumentStore, ToolInputError, format_page
from openk3.rl.task_file import load_task
from openk3.rl.tools import ToolCall, parse_call, run_tool
from openk3.rl.trajectory import ToolStatus

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "harbour"

FIXTURE = [
    Document("apple", "Apple", "apple apple pie", ()),
    Document("banana", "Banana", "banana bread", ("apple",)),
    Document("cherry", "Cherry", "apple banana", ()),
]


def bm25(tf: int, length: int, avg: float, n: int, df: int) -> float:
    idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
    return idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * length / avg))


def test_bm25_scores_and_order_match_the_formula_by_hand() -> None:
    store = DocumentStore(FIXTURE)
    # words, title included: apple = apple x3 + pie (4), banana = banana x2 + bread (3), cherry = cherry apple banana (3)
    hits = store.search("apple", 3)
    assert [h.doc_id for h in hits] == ["apple", "cherry"]  # banana has no "apple": score 0 is not returned
    avg = 10 / 3
    assert hits[0].score == pytest.approx(bm25(3, 4, avg, 3, 2), rel=1e-12)
    assert hits[1].score == pytest.approx(bm25(1, 3, avg, 3, 2), rel=1e-12)
    two = store.search("banana pie", 3)  # banana: df 2; pie: df 1
    expected = {
        "apple": bm25(1, 4, avg, 3, 1),
        "banana": bm25(2, 3, avg, 3, 2),
        "cherry": bm25(1, 3, avg, 3, 2),
    }
    assert [h.doc_id for h in two] == sorted(expected, key=lambda i: -expected[i])
    for h in two:
        assert h.score == pytest.approx(expected[h.doc_id], rel=1e-12)
    assert store.search("APPLE, apple!", 3) == hits  # case and punctuation do not matter; a repeated word counts once
    assert store.search("apple", 1) == hits[:1]
    assert store.search("durian", 3) == []


def test_ties_are_broken_by_doc_id_whatever_the_input_order() -> None:
    docs = [Document(i, "T", "same words here", ()) for i in ("zeta", "alpha", "mid")]
    for order in (docs, docs[::-1]):
        assert [h.doc_id for h in DocumentStore(order).search("words", 3)] == ["alpha", "mid", "zeta"]


def test_pages_split_at_line_ends_and_cut_an_overlong_line() -> None:
    doc = Document("d", "D", "aaaa\nbbbb\ncc\n" + "x" * 12, ())
    assert doc.pages(9) == ["aaaa\nbbbb", "cc", "x" * 9, "xxx"]
    store = DocumentStore([doc], page_chars=9)
    page = store.open("d", 2)
    assert (page.number, page.count, page.text) == (2, 4, "cc")
    assert 'more: <open page="3">d</open>' in format_page(page)


@pytest.mark.parametrize("doc_id", ["../../etc/passwd", "/etc/passwd", "pages/ferry", "ferry.md", "", "ferry\x00", "x" * 100_000, ".", "FERRY"])
def test_hostile_doc_ids_are_tool_errors(doc_id: str) -> None:
    store = load_task(EXAMPLE / "task.json").documents
    assert store is not None
    with pytest.raises(ToolInputError, match="no document"):
        store.open(doc_id)
    status, code, body = run_tool(ToolCall("open", doc_id), None, "unused", store, 1.0)  # type: ignore[arg-type]
    assert status == ToolStatus.INVALID and code is None and body.startswith("error: no document")
    assert len(body) < 300  # a huge id is not echoed back whole


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ('<open page="99999999999999">ferry</open>', "expected a whole number"),
        ('<open page="999999999">ferry</open>', "page 999999999 does not exist"),
        ('<open page="0">ferry</open>', "page 0 does not exist"),
        ('<open page="-1">ferry</open>', "expected a whole number"),
        ('<open page="1e3">ferry</open>', "expected a whole number"),
        ('<open page="1" page="2">ferry</open>', "given twice"),
        ('<open path="/etc/passwd">ferry</open>', "takes no attribute 'path'"),
        ("<open page=2>ferry</open>", "cannot read the attributes"),
        (f'<search k="{MAX_K + 1}">ferry</search>', f"expected 1 to {MAX_K}"),
        ('<search k="0">ferry</search>', "expected 1 to"),
        ("<search>  ...  </search>", "has no words"),
        (f"<search>{'a ' * 400}</search>", "at most 500"),
        ('<bash k="1">ls</bash>', "bash takes no attribute"),
    ],
)
def test_bad_arguments_are_invalid_calls_with_a_message(reply: str, message: str) -> None:
    store = load_task(EXAMPLE / "task.json").documents
    call = parse_call(reply)
    assert call is not None and not call.malformed
    status, _, body = run_tool(call, None, "unused", store, 1.0)  # type: ignore[arg-type]
    assert status == ToolStatus.INVALID
    assert message in body


def test_unclosed_calls_are_malformed_and_a_store_less_task_refuses_search() -> None:
    for reply, tool in (("<search>ferry", "search"), ("<open page='2'>x", "open"), ("text <bash>ls", "bash")):
        call = parse_call(reply)
        assert call is not None and call.malformed and call.tool == tool
        status, _, body = run_tool(call, None, "unused", None, 1.0)  # type: ignore[arg-type]
        assert status == ToolStatus.MALFORMED and f"a {tool} call must be" in body
    assert parse_call("no call here, <b>bold</b>") is None
    first = parse_call("<open>a</open> then <search>b</search>")
    assert first == ToolCall("open", "a")
    status, _, body = run_tool(ToolCall("search", "ferry"), None, "unused", None, 1.0)  # type: ignore[arg-type]
    assert status == ToolStatus.INVALID and "no document store" in body


def test_a_store_folder_is_checked_when_the_task_loads(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n[to b](b)\n")
    with pytest.raises(ValueError, match=r"links to \['b'\]"):
        DocumentStore.from_folder(tmp_path)
    (tmp_path / "b.md").write_text("no title line\n")
    with pytest.raises(ValueError, match="first line must be"):
        DocumentStore.from_folder(tmp_path)
    (tmp_path / "b.md").write_text("# B\n")
    assert sorted(DocumentStore.from_folder(tmp_path).docs) == ["a", "b"]
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a regular .md file"):
        DocumentStore.from_folder(tmp_path)
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "c.md").symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match="not a regular .md file"):
        DocumentStore.from_folder(tmp_path)


def test_the_example_task_answers_its_question_through_search_and_open() -> None:
    task = load_task(EXAMPLE / "task.json")
    store = task.documents
    assert store is not None and len(store.docs) == 6
    assert store.search("Harrowmere ferry", 1)[0].doc_id == "ferry"
    ferry = store.open("ferry")
    assert ("tollan-isle", "Tollan Isle") in ferry.links
    assert store.search("who built the lighthouse", 1)[0].doc_id == "tollan-lighthouse"
    page = store.open("tollan-lighthouse", 2)
    assert page.count == 2 and "built by the stonemason Maren Ashby" in page.text
    assert "Maren Ashby" not in store.open("tollan-lighthouse", 1).text  # the answer needs the second page
