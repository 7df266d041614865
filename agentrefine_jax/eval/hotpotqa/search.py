"""The two page-search backends behind HotpotQA's `search[...]`/`lookup[...]` actions.

Both answer `search(entity)` with a `Page` (its sentences) or `NotFound` (similar titles), the
distinction ReAct's and LATS's Wikipedia environment draws:

- `ContextBackend` (offline): the question's own context paragraphs are the whole encyclopedia.
  A title matches case-insensitively (underscores as spaces); a title whose only difference is a
  trailing "(disambiguator)" matches when it is the only such paragraph, as Wikipedia's search box
  goes to the article. Otherwise the paragraphs sharing words with the entity (title words first)
  are the similar titles.
- `WikipediaBackend` (live): MediaWiki's action API at a configurable base URL. The page is asked
  for by exact title (redirects followed, plain-text extract); a missing or disambiguation page
  falls back to a full-text search, whose top hit is opened when its title equals the entity up to
  case (what the search box's "go" does) and otherwise listed as similar titles.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from agentrefine_jax import http_client
from agentrefine_jax.eval.hotpotqa.scoring import normalize_answer

DEFAULT_WIKIPEDIA_URL = "https://en.wikipedia.org/w/api.php"
# Wikipedia asks API clients to identify themselves.
HEADERS = {
    "User-Agent": "agentrefine_jax-hotpotqa/1.0 (HotpotQA agent evaluation)",
    "Accept": "application/json",
}
# ReAct's environment lists at most five similar titles.
MAX_SIMILAR = 5

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_PARENTHETICAL = re.compile(r"\s*\([^()]*\)\s*$")


@dataclasses.dataclass(frozen=True)
class Page:
    title: str
    sentences: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class NotFound:
    similar: tuple[str, ...]


class SearchBackend(Protocol):
    name: str

    def search(self, entity: str) -> Page | NotFound: ...


class SearchError(RuntimeError):
    """The search service failed (network, deadline, API error); the episode ends as an error."""


def title_key(title: str) -> str:
    return " ".join(title.replace("_", " ").split()).casefold()


def split_sentences(text: str) -> tuple[str, ...]:
    """Paragraph text -> sentences (split after . ! ? followed by whitespace), blank lines dropped."""
    out: list[str] = []
    for line in text.splitlines():
        out += [s.strip() for s in _SENTENCE_END.split(line) if s.strip()]
    return tuple(out)


class ContextBackend:
    name = "context"

    def __init__(self, context: Sequence[tuple[str, Sequence[str]]]):
        self._pages = [Page(title, tuple(sentences)) for title, sentences in context]
        self._by_key = {title_key(p.title): p for p in self._pages}

    def search(self, entity: str) -> Page | NotFound:
        key = title_key(entity)
        if key in self._by_key:
            return self._by_key[key]
        bare = [p for p in self._pages if title_key(_PARENTHETICAL.sub("", p.title)) == key]
        if len(bare) == 1:
            return bare[0]
        return NotFound(self._similar(entity))

    def _similar(self, entity: str) -> tuple[str, ...]:
        words = set(normalize_answer(entity).split())
        scored = []
        for i, p in enumerate(self._pages):
            in_title = len(words & set(normalize_answer(p.title).split()))
            in_text = len(words & set(normalize_answer(" ".join(p.sentences)).split()))
            if in_title or in_text:
                scored.append((-in_title, -in_text, i, p.title))
        return tuple(title for *_, title in sorted(scored)[:MAX_SIMILAR])


class WikipediaBackend:
    """MediaWiki action API client; one instance serves a whole run and caches what it fetched."""

    name = "wikipedia"

    def __init__(self, base_url: str = DEFAULT_WIKIPEDIA_URL, *, timeout: float = 20.0, retries: int = 2):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"bad Wikipedia API URL {base_url!r}; expected e.g. {DEFAULT_WIKIPEDIA_URL}")
        if timeout <= 0 or retries < 0:
            raise ValueError("the Wikipedia timeout must be > 0 and retries >= 0")
        self.base_url = base_url
        self.timeout = timeout
        self.retries = retries
        self._cache: dict[str, Page | NotFound] = {}

    def search(self, entity: str) -> Page | NotFound:
        # Wikipedia titles are case-sensitive after the first letter: the cache key keeps case.
        key = " ".join(entity.split())
        if key not in self._cache:
            self._cache[key] = self._search(entity)
        return self._cache[key]

    def _search(self, entity: str) -> Page | NotFound:
        page = self._page(entity)
        if page is not None:
            return page
        hits = self._query(list="search", srsearch=entity, srlimit=str(MAX_SIMILAR), srnamespace="0")
        titles = tuple(h["title"] for h in hits.get("search", []) if isinstance(h, Mapping) and "title" in h)
        if titles and title_key(titles[0]) == title_key(entity) and titles[0] != entity:
            page = self._page(titles[0])
            if page is not None:
                return page
        return NotFound(titles[:MAX_SIMILAR])

    def _page(self, title: str) -> Page | None:
        """The article with this exact title (after redirects), or None if missing/disambiguation."""
        query = self._query(
            prop="extracts|pageprops", explaintext="1", ppprop="disambiguation", redirects="1", titles=title
        )
        pages = query.get("pages") or []
        if not pages:
            return None
        page = pages[0]
        if page.get("missing") or page.get("invalid") or "disambiguation" in (page.get("pageprops") or {}):
            return None
        return Page(page.get("title", title), _extract_sentences(page.get("extract") or ""))

    def _query(self, **params: str) -> dict[str, Any]:
        doc = self._get_json({"action": "query", "format": "json", "formatversion": "2", **params})
        if "error" in doc:
            err = doc["error"]
            raise SearchError(f"Wikipedia API error {err.get('code')}: {err.get('info')}")
        return doc.get("query") or {}

    def _get_json(self, params: Mapping[str, str]) -> dict[str, Any]:
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(0.5 * attempt)
            try:
                # One overall deadline per request (connect, headers and body), whatever the server does.
                reply = http_client.request(
                    "GET", self.base_url, params=dict(params), timeout=self.timeout, headers=HEADERS
                )
            except (http_client.RequestTimeout, http_client.RequestFailed) as e:
                last = e
                continue
            if reply.status == 429 or reply.status >= 500:
                last = SearchError(f"HTTP {reply.status}")
                continue
            if reply.status != 200:
                raise SearchError(f"Wikipedia API at {self.base_url} answered HTTP {reply.status}")
            try:
                doc = reply.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SearchError(f"Wikipedia API at {self.base_url} sent no JSON: {e}") from None
            if not isinstance(doc, dict):
                raise SearchError(f"Wikipedia API at {self.base_url} sent unexpected JSON")
            return doc
        tries = self.retries + 1
        raise SearchError(
            f"Wikipedia API at {self.base_url} failed after {tries} attempt{'s' * (tries > 1)}: {last}"
        )


def _extract_sentences(extract: str) -> tuple[str, ...]:
    """A plain-text extract -> sentences; section headings and lines of <= 2 words (list debris) dropped
    as ReAct's page text keeps only paragraphs and lists longer than two words."""
    lines = [
        line for line in extract.splitlines() if not line.strip().startswith("==") and len(line.split()) > 2
    ]
    return split_sentences("\n".join(lines))
