"""A task's document store: a small collection of pages shipped with the task, a BM25 index over them, and the two tools an
agent uses on it, `search(query, k)` (ranked doc ids, titles and snippets) and `open(doc_id, page)` (one page of a
document's text, with its outgoing links).

The store is operator data: it is read once, from the folder the task file names, when the task is loaded, and kept in
memory. Nothing the policy writes (a query, a doc id, a page number) reaches a path: a doc id is a key of the in-memory
table, looked up and never joined to anything, and a bad id, page or `k` raises `ToolInputError`, which the runner
records in the trajectory as the tool's answer (rl/tools.py), never as a crash.

Folder format: every entry is a `<doc_id>.md` file (doc ids `[A-Za-z0-9][A-Za-z0-9_-]*`); its first line is `# Title`, the
rest is the body; `[text](other_id)` in the body links to another document of the store (a link to an id the store does
not have is a load error, as is any other entry in the folder: nothing is skipped silently).

Ranking: Okapi BM25 (k1 = 1.2, b = 0.75) with the non-negative idf ln(1 + (N - df + 0.5) / (df + 0.5)), over lower-cased
alphanumeric words of the title and the body (the title once, as part of the document); a query word counts once however
often it is repeated. Ties are broken by doc id, so a ranking is deterministic. Documents with score 0 (no query word)
are not returned.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DOC_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)\)")
WORD = re.compile(r"[^\W_]+")
K1, B = 1.2, 0.75
MAX_K = 10
MAX_QUERY_CHARS = 500
PAGE_CHARS = 1200  # a page must fit the observation the policy reads (rl/tools.py MAX_OBSERVATION_CHARS), with its links
SNIPPET_CHARS = 160
MAX_ECHO = 80  # how much of a bad argument an error message repeats


class ToolInputError(ValueError):
    """A search or open call the store cannot answer (its message is what the policy reads)."""


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def echo(text: str) -> str:
    """A policy-written argument, quoted and cut short, for an error message."""
    return repr(text[:MAX_ECHO] + ("..." if len(text) > MAX_ECHO else ""))


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    body: str
    links: tuple[str, ...]  # the doc ids the body links to, in order of first appearance

    @classmethod
    def parse(cls, doc_id: str, text: str, where: str) -> Document:
        first, _, body = text.partition("\n")
        if not first.startswith("# ") or not first[2:].strip():
            raise ValueError(f"{where}: the first line must be '# Title', got {first[:80]!r}")
        links = tuple(dict.fromkeys(target for _, target in LINK.findall(body)))
        return cls(doc_id, first[2:].strip(), body.strip("\n"), links)

    def pages(self, page_chars: int) -> list[str]:
        """The body cut into pages of at most `page_chars` characters, at line ends where a line fits."""
        pages: list[str] = []
        current = ""
        for line in self.body.split("\n"):
            while len(line) > page_chars:  # a line longer than a page is cut
                if current:
                    pages.append(current)
                    current = ""
                pages.append(line[:page_chars])
                line = line[page_chars:]
            if current and len(current) + 1 + len(line) > page_chars:
                pages.append(current)
                current = line
            else:
                current = f"{current}\n{line}" if current else line
        if current or not pages:
            pages.append(current)
        return pages


@dataclass(frozen=True)
class SearchHit:
    doc_id: str
    title: str
    score: float
    snippet: str


@dataclass(frozen=True)
class Page:
    doc_id: str
    title: str
    number: int  # 1-based
    count: int
    text: str
    links: tuple[tuple[str, str], ...]  # (doc id, its title) of every document this one links to


class DocumentStore:
    """The documents of one task and their BM25 index (module docstring); immutable once built."""

    def __init__(self, documents: Sequence[Document], page_chars: int = PAGE_CHARS) -> None:
        if not documents:
            raise ValueError("a document store needs at least one document")
        if page_chars < 1:
            raise ValueError(f"DocumentStore: page_chars={page_chars}, expected >= 1")
        self.docs = {d.doc_id: d for d in documents}
        if len(self.docs) != len(documents):
            raise ValueError("a document store has two documents with one id")
        for d in documents:
            if DOC_ID.fullmatch(d.doc_id) is None:
                raise ValueError(f"document id {d.doc_id!r}: expected letters, digits, '-' and '_', starting with a letter or digit")
            unknown = [t for t in d.links if t not in self.docs]
            if unknown:
                raise ValueError(f"document {d.doc_id!r} links to {unknown}, which the store does not have")
        self.page_chars = page_chars
        self.pages = {d.doc_id: d.pages(page_chars) for d in documents}
        self.tf = {d.doc_id: Counter(words(f"{d.title}\n{d.body}")) for d in documents}
        self.length = {i: sum(tf.values()) for i, tf in self.tf.items()}
        self.avg_length = sum(self.length.values()) / len(self.length)
        df: Counter[str] = Counter()
        for tf in self.tf.values():
            df.update(tf.keys())
        n = len(documents)
        self.idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}

    @classmethod
    def from_folder(cls, folder: Path, page_chars: int = PAGE_CHARS) -> DocumentStore:
        if not folder.is_dir():
            raise ValueError(f"document store {folder}: not a folder")
        documents = []
        for path in sorted(folder.iterdir()):
            if path.is_symlink() or not path.is_file() or path.suffix != ".md":
                raise ValueError(f"document store {folder}: {path.name!r} is not a regular .md file (a store holds only its pages)")
            documents.append(Document.parse(path.stem, path.read_text(encoding="utf-8"), str(path)))
        return cls(documents, page_chars)

    def score(self, doc_id: str, query_words: set[str]) -> float:
        tf, norm = self.tf[doc_id], K1 * (1 - B + B * self.length[doc_id] / self.avg_length)
        return sum(self.idf[w] * tf[w] * (K1 + 1) / (tf[w] + norm) for w in query_words if tf[w] > 0)

    def search(self, query: str, k: int) -> list[SearchHit]:
        """The `k` best documents for `query` (module docstring), best first."""
        if not 1 <= k <= MAX_K:
            raise ToolInputError(f"k={k}: expected 1 to {MAX_K}")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolInputError(f"the query has {len(query)} characters, at most {MAX_QUERY_CHARS}")
        query_words = set(words(query))
        if not query_words:
            raise ToolInputError(f"the query {echo(query)} has no words")
        scored = [(self.score(i, query_words), i) for i in self.docs]
        ranked = sorted(((s, i) for s, i in scored if s > 0), key=lambda si: (-si[0], si[1]))
        return [SearchHit(i, self.docs[i].title, s, self.snippet(i, query_words)) for s, i in ranked[:k]]

    def snippet(self, doc_id: str, query_words: set[str]) -> str:
        """About SNIPPET_CHARS of the body around its first query word (its start when only the title matched)."""
        body = " ".join(self.docs[doc_id].body.split())
        start = 0
        for m in WORD.finditer(body):
            if m.group().lower() in query_words:
                start = max(0, m.start() - SNIPPET_CHARS // 4)
                break
        text = body[start : start + SNIPPET_CHARS]
        return ("..." if start > 0 else "") + text + ("..." if start + SNIPPET_CHARS < len(body) else "")

    def open(self, doc_id: str, page: int = 1) -> Page:
        """Page `page` (1-based) of document `doc_id`."""
        doc = self.docs.get(doc_id)
        if doc is None:
            raise ToolInputError(f"no document {echo(doc_id)}; search for one and open it by the id the results give")
        pages = self.pages[doc_id]
        if not 1 <= page <= len(pages):
            raise ToolInputError(f"document {doc_id!r} has {len(pages)} page(s), page {page} does not exist")
        links = tuple((t, self.docs[t].title) for t in doc.links)
        return Page(doc_id, doc.title, page, len(pages), pages[page - 1], links)


def format_hits(query: str, hits: list[SearchHit]) -> str:
    """What the policy reads back from a search."""
    if not hits:
        return f"no document matches {echo(query)}"
    lines = []
    for rank, h in enumerate(hits, 1):
        lines.append(f"{rank}. [{h.doc_id}] {h.title} (score {h.score:.3f})\n   {h.snippet}")
    return "\n".join(lines)


def format_page(p: Page) -> str:
    """What the policy reads back from an open: the page, where it is, and the ids it may open next."""
    head = f"[{p.doc_id}] {p.title} (page {p.number} of {p.count})"
    links = "; ".join(f"{i} ({title})" for i, title in p.links) if p.links else "none"
    more = f'\n(more: <open page="{p.number + 1}">{p.doc_id}</open>)' if p.number < p.count else ""
    return f"{head}\n\n{p.text}\n\nlinks: {links}{more}"
