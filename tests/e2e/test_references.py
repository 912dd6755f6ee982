"""Every citation in the docs and the README resolves through docs/references.md to authors, title
and address (issue 30): arXiv numbers, web addresses and the names next to them and to links to
that page; and the claim "sequence-level MIS beats token-level" is attributed to its source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFERENCES = REPO / "docs" / "references.md"
DOCS = sorted(p for p in (REPO / "docs").glob("*.md") if p != REFERENCES) + [REPO / "README.md"]

ARXIV = re.compile(r"(?:arXiv:\s?|arxiv\.org/(?:abs|pdf|html)/)(\d{4}\.\d{4,5})", re.I)
#: a web address, with or without a scheme (the docs write `lmsys.org/blog/...` inline, too)
ADDRESS = re.compile(r"(?:https?://)?\b((?:[a-z0-9-]+\.)+(?:org|com|ai|site|xyz|io|net|dev)/[^\s)>\]|`'\"]*)", re.I)
#: how far before an arXiv number or a link to references.md the cited name must stand
WINDOW = 120


def _entries(text: str) -> dict[str, dict]:
    """``{heading: {"fields": {Title/Authors/Address/...: value}, "names": [...], "body": str}}``."""
    out = {}
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        fields = {}
        for m in re.finditer(r"^- ([A-Z][a-z ]+): (.*(?:\n  .*)*)", body, re.M):
            fields[m.group(1)] = " ".join(m.group(2).split())
        names = [heading.strip()] + [n.strip() for n in fields.get("Also cited as", "").split(";") if n.strip()]
        out[heading.strip()] = {"fields": fields, "names": names, "body": body}
    return out


ENTRIES = _entries(REFERENCES.read_text(encoding="utf-8"))
REFERENCES_TEXT = REFERENCES.read_text(encoding="utf-8")


def _flat(path: Path) -> str:
    """The file's text with line breaks as spaces (a citation may wrap)."""
    return re.sub(r"\s*\n\s*", " ", path.read_text(encoding="utf-8"))


def _names_before(text: str, pos: int) -> str:
    return text[max(0, pos - WINDOW):pos]


def test_every_entry_gives_title_authors_and_address():
    assert len(ENTRIES) >= 8, sorted(ENTRIES)
    for heading, entry in ENTRIES.items():
        for field in ("Title", "Authors", "Address"):
            value = entry["fields"].get(field, "")
            assert value, f"docs/references.md: '{heading}' has no {field} line"
        address = entry["fields"]["Address"]
        assert address.startswith("not confirmed") or re.search(r"<https?://[^>]+>", address), (heading, address)
        for arxiv in ARXIV.findall(entry["body"]):
            assert f"<https://arxiv.org/abs/{arxiv}>" in entry["body"], f"{heading}: arXiv:{arxiv} without its address"


def _arxiv_owner(number: str) -> dict | None:
    for entry in ENTRIES.values():
        if number in ARXIV.findall(entry["body"]):
            return entry
    return None


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_arxiv_numbers_resolve_and_match_the_name_beside_them(path):
    text = _flat(path)
    for m in ARXIV.finditer(text):
        entry = _arxiv_owner(m.group(1))
        assert entry is not None, f"{path.name}: arXiv:{m.group(1)} is not in docs/references.md"
        before = _names_before(text, m.start())
        assert any(name in before for name in entry["names"]), (
            f"{path.name}: arXiv:{m.group(1)} is {entry['names'][0]!r} in docs/references.md, but that name is not "
            f"written before it: ...{before[-80:]!r}"
        )


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_web_addresses_resolve(path):
    text = path.read_text(encoding="utf-8")
    for m in ADDRESS.finditer(text):
        address = m.group(1).rstrip(".,;:")
        assert address in REFERENCES_TEXT, f"{path.name}: {address} is not in docs/references.md"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_to_the_references_name_a_source_listed_there(path):
    """``Source (docs/references.md)`` / ``Source's claim (...; [docs/references.md](...))``: the
    source named just before a link to the page must be one of its entries."""
    text = _flat(path)
    names = [n for entry in ENTRIES.values() for n in entry["names"]]
    for m in re.finditer(r"(?<!\]\()docs/references\.md", text):
        before = _names_before(text, m.start())
        assert any(name in before for name in names), (
            f"{path.name}: a link to docs/references.md names no source listed there: ...{before[-80:]!r}"
        )


def test_sequence_over_token_claim_is_attributed_to_when_speed_kills_stability():
    """The claim is When Speed Kills Stability's: the Qwen team's paper recommends token-level
    IS-corrected policy gradients on-policy, and the Ling team's IcePop is token-level."""
    claim = re.compile(r"sequence-level MIS (?:beats|>|is better than) token-level", re.I)
    found = 0
    for path in DOCS:
        text = _flat(path)
        for m in claim.finditer(text):
            found += 1
            before = _names_before(text, m.start())
            assert "When Speed Kills Stability" in before and not re.search(r"\b(Qwen|Ling)\b", before), (
                f"{path.name}: ...{before[-100:]!r} {m.group(0)}"
            )
    assert found >= 3  # README and the study's two result sections
