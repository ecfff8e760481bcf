"""A tiny search engine over the bundled documents in ``examples/data/corpus``."""

from __future__ import annotations

import math
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

from examples.llm import words

CORPUS = Path(__file__).parent / "data" / "corpus"


@lru_cache(maxsize=1)
def _index() -> dict[str, dict]:
    docs = {}
    for path in sorted(CORPUS.glob("*.md")):
        text = path.read_text()
        title = text.splitlines()[0].lstrip("# ").strip()
        paragraphs = [p.strip() for p in text.split("\n\n")[1:] if p.strip()]
        docs[path.stem] = {"title": title, "paragraphs": paragraphs, "terms": Counter(words(text))}
    return docs


def search(query: str, limit: int = 3) -> list[dict]:
    """BM25-ish ranking of paragraphs; returns ``[{"doc", "title", "text", "score"}]``."""
    docs = _index()
    terms = words(query)
    n = len(docs)
    hits = []
    for doc_id, doc in docs.items():
        for paragraph in doc["paragraphs"]:
            counts = Counter(words(paragraph))
            score = 0.0
            for term in terms:
                df = sum(1 for d in docs.values() if term in d["terms"])
                if counts[term]:
                    idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                    score += idf * counts[term] * 2.2 / (counts[term] + 1.2)
            if score > 0:
                hits.append(
                    {
                        "doc": doc_id,
                        "title": doc["title"],
                        "text": re.sub(r"\s+", " ", paragraph),
                        "score": round(score, 3),
                    }
                )
    hits.sort(key=lambda h: (-h["score"], h["doc"]))
    return hits[:limit]


def document_ids() -> list[str]:
    return list(_index())
