"""The host patches in ``patches/`` are well-formed, never touch the same lines, and every example
script names them in an order in which they apply with exact line numbers.

No host source is needed (CI has no network, and we may not commit host code): the facts about the
real trees are the rows of :data:`VERIFIED_BASE_RANGES` — where each hunk lands when its patch is
applied ALONE to the pristine host file (its "base" range, context lines included). They were
recorded and checked with ``git apply --check`` / ``git apply -v`` against the real trees, slime
624b824a898ab0ec1fcb4d373004c7f3852bf515 and Miles 31f1ca961a94cb860cec3b2dea34ec332bfa8f76, on
2026-11-24 (every patch alone, and each example script's patches in its order, all applied without
a shifted hunk). To re-run that check after editing a patch::

    git clone https://github.com/radixark/miles && git -C miles checkout 31f1ca96
    git clone https://github.com/THUDM/slime && git -C slime checkout 624b824a
    tools/check_patches.sh miles      # prints the rows below and fails where they differ
    tools/check_patches.sh slime

The megatron-core patch was checked on the same day with ``git apply --check`` against the files of
the megatron-core 0.15.3 wheel (``pip download megatron-core==0.15.3 --no-deps``, unzip, run it
from the unzipped root); no example script applies it, so here it is only checked for form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATCHES = sorted((REPO / "patches").glob("*.patch"))
SCRIPTS = sorted((REPO / "examples").glob("*/*.sh"))

# patch -> [(file, base line where the hunk starts, number of base lines it covers)], in the
# patch's hunk order; recorded by tools/check_patches.sh against the real trees (see docstring).
VERIFIED_BASE_RANGES = {
    "miles-31f1ca96-global-mis-normalizer.patch": [("miles/backends/megatron_utils/actor.py", 567, 4)],
    "miles-31f1ca96-length-decay.patch": [
        ("miles/backends/megatron_utils/actor.py", 563, 4),
        ("miles/backends/megatron_utils/model.py", 110, 6),
        ("miles/backends/megatron_utils/model.py", 853, 6),
    ],
    "slime-624b824a-length-decay.patch": [
        ("slime/backends/megatron_utils/model.py", 231, 6),
        ("slime/backends/megatron_utils/model.py", 897, 6),
    ],
}

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True, slots=True)
class Hunk:
    path: str
    old_start: int
    old_count: int
    new_start: int
    new_count: int
    lineno: int  # line of the @@ header in the patch file

    @property
    def delta(self) -> int:
        return self.new_count - self.old_count


class PatchFormatError(ValueError):
    pass


def parse_patch(text: str, name: str = "<patch>") -> list[Hunk]:
    """Hunks of a git-style unified diff; raises PatchFormatError naming the line on any defect:
    a hunk whose body does not hold exactly the counted old / new lines, a body line that is not
    ' ', '+', '-' or '\\', a file section without ``--- a/`` and ``+++ b/`` lines, no hunk at all."""
    lines = text.splitlines()
    hunks: list[Hunk] = []
    path = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            m = re.fullmatch(r"diff --git a/(\S+) b/(\S+)", line)
            if not m or m[1] != m[2]:
                raise PatchFormatError(f"{name}:{i + 1}: expected 'diff --git a/P b/P', got {line!r}")
            path = None
            j = i + 1
            while j < len(lines) and not lines[j].startswith("@@"):
                if lines[j].startswith("+++ "):
                    if lines[j] != f"+++ b/{m[1]}" or lines[j - 1] != f"--- a/{m[1]}":
                        raise PatchFormatError(f"{name}:{j + 1}: '--- a/{m[1]}' / '+++ b/{m[1]}' expected")
                    path = m[1]
                j += 1
            if path is None:
                raise PatchFormatError(f"{name}:{i + 1}: no '+++ b/{m[1]}' line before the first hunk")
            i = j
            continue
        m = _HUNK.match(line)
        if m:
            if path is None:
                raise PatchFormatError(f"{name}:{i + 1}: hunk before any 'diff --git' header")
            old_count = int(m[2]) if m[2] is not None else 1
            new_count = int(m[4]) if m[4] is not None else 1
            seen_old = seen_new = 0
            j = i + 1
            while j < len(lines) and (seen_old < old_count or seen_new < new_count):
                body = lines[j]
                tag = body[:1]
                if tag == " " or body == "":  # an empty line is a blank context line
                    seen_old += 1
                    seen_new += 1
                elif tag == "-":
                    seen_old += 1
                elif tag == "+":
                    seen_new += 1
                elif tag != "\\":
                    break
                j += 1
            while j < len(lines) and lines[j].startswith("\\"):
                j += 1
            if (seen_old, seen_new) != (old_count, new_count):
                raise PatchFormatError(
                    f"{name}:{i + 1}: hunk {line!r} counts {old_count} old / {new_count} new lines, "
                    f"its body has {seen_old} / {seen_new}"
                )
            if j < len(lines) and not (lines[j].startswith(("@@", "diff --git ")) or lines[j][:1] in "-+ "):
                raise PatchFormatError(f"{name}:{j + 1}: unexpected line after hunk {line!r}: {lines[j]!r}")
            if j < len(lines) and lines[j][:1] in "-+ " and not lines[j].startswith("diff --git "):
                raise PatchFormatError(f"{name}:{j + 1}: hunk {line!r} has more body lines than it counts")
            hunks.append(Hunk(path, int(m[1]), old_count, int(m[3]), new_count, i + 1))
            i = j
            continue
        if path is not None:
            raise PatchFormatError(f"{name}:{i + 1}: unexpected line between hunks: {line!r}")
        i += 1  # the free-text description before the first 'diff --git' (git apply skips it)
    if not hunks:
        raise PatchFormatError(f"{name}: no hunk")
    return hunks


def check_hunk_order(hunks: list[Hunk], name: str) -> None:
    """Within one patch, one file's hunks are ascending and disjoint, and each new_start counts
    the lines the earlier hunks of that file added."""
    shift: dict[str, int] = {}
    end: dict[str, int] = {}
    for h in hunks:
        if h.old_start <= end.get(h.path, 0):
            raise PatchFormatError(f"{name}:{h.lineno}: hunk at {h.old_start} overlaps or precedes the previous one")
        expected_new = h.old_start + shift.get(h.path, 0)
        if h.new_start != expected_new:
            raise PatchFormatError(f"{name}:{h.lineno}: new start {h.new_start}, expected {expected_new}")
        shift[h.path] = shift.get(h.path, 0) + h.delta
        end[h.path] = h.old_start + h.old_count - 1


def base_ranges(name: str) -> list[tuple[str, int, int]]:
    return VERIFIED_BASE_RANGES[name]


def check_script_order(names: list[str], parsed: dict[str, list[Hunk]]) -> None:
    """Apply ``names`` in order on paper: each hunk's header start must equal its verified base
    start plus the lines that the earlier patches' hunks above it (same file) added; two patches may
    not cover the same base lines. Raises PatchFormatError naming the patch and hunk."""
    applied: list[tuple[str, str, int, int, int]] = []  # (patch, file, base start, base count, delta)
    for name in names:
        for h, (path, base_start, base_count) in zip(parsed[name], base_ranges(name), strict=True):
            if (h.path, h.old_count) != (path, base_count):
                raise PatchFormatError(f"{name}:{h.lineno}: hunk covers {h.path} x{h.old_count}, recorded {path} x{base_count}")
            shift = 0
            for other, o_path, o_start, o_count, o_delta in applied:
                if o_path != path:
                    continue
                if o_start <= base_start + base_count - 1 and base_start <= o_start + o_count - 1:
                    raise PatchFormatError(
                        f"{name} hunk at {path}:{base_start} touches base lines {o_start}-{o_start + o_count - 1} "
                        f"that {other} also touches"
                    )
                if o_start < base_start:
                    shift += o_delta
            if h.old_start != base_start + shift:
                raise PatchFormatError(
                    f"{name}:{h.lineno}: hunk at line {h.old_start} of {path}, but after "
                    f"{[a[0] for a in applied] or 'nothing'} it lands at {base_start + shift}"
                )
        applied.extend((name, p, s, c, h.delta) for h, (p, s, c) in zip(parsed[name], base_ranges(name), strict=True))


def script_patches(script: Path) -> list[str]:
    """The patches a script names, in the order it first names them."""
    return list(dict.fromkeys(re.findall(r"patches/([\w.-]+\.patch)", script.read_text())))


@pytest.fixture(scope="module")
def parsed() -> dict[str, list[Hunk]]:
    return {p.name: parse_patch(p.read_text(), p.name) for p in PATCHES}


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_is_well_formed(patch):
    hunks = parse_patch(patch.read_text(), patch.name)
    check_hunk_order(hunks, patch.name)


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_names_its_host_commit(patch):
    host, short = patch.name.split("-")[:2]
    if host == "megatron":
        assert "0.15.3" in patch.name
        return
    assert host in ("slime", "miles")
    full = re.search(rf"\b({short}[0-9a-f]{{{40 - len(short)}}})\b", patch.read_text())
    assert full, f"{patch.name} must name the full commit starting with {short}"


def test_every_host_patch_has_verified_base_ranges(parsed):
    host_patches = {n for n in parsed if n.startswith(("slime-", "miles-"))}
    assert host_patches == set(VERIFIED_BASE_RANGES)
    for name in host_patches:
        got = [(h.path, h.old_count) for h in parsed[name]]
        assert got == [(p, c) for p, _, c in VERIFIED_BASE_RANGES[name]], name


def test_patches_of_one_host_touch_disjoint_lines():
    by_file: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    for name, rows in VERIFIED_BASE_RANGES.items():
        for path, start, count in rows:
            by_file.setdefault((name.split("-")[0], path), []).append((start, start + count - 1, name))
    for (host, path), ranges in by_file.items():
        ranges.sort()
        for (s1, e1, n1), (s2, e2, n2) in zip(ranges, ranges[1:]):
            if n1 != n2:
                assert e1 < s2, f"{n1} ({s1}-{e1}) and {n2} ({s2}-{e2}) touch the same lines of {host} {path}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_names_existing_patches_in_an_order_that_applies(script, parsed):
    names = script_patches(script)
    for name in names:
        assert name in parsed, f"{script.name} names patches/{name}, which does not exist"
        assert name.startswith(f"{script.parent.name}-"), f"{script.name} names another host's patch {name}"
    check_script_order(names, parsed)


def test_miles_script_names_both_patches_length_decay_first():
    (script,) = (REPO / "examples" / "miles").glob("run-*.sh")
    assert script_patches(script) == ["miles-31f1ca96-length-decay.patch", "miles-31f1ca96-global-mis-normalizer.patch"]


# ---- the checker itself catches the defects it is for -----------------------------------------------

_GOOD = """description
diff --git a/x.py b/x.py
--- a/x.py
+++ b/x.py
@@ -10,3 +10,4 @@ def f():
 a
+b
 c
 d
@@ -20,2 +21,2 @@
-e
+E
 f
"""


def test_parser_reads_a_good_patch():
    hunks = parse_patch(_GOOD)
    assert [(h.old_start, h.old_count, h.new_start, h.new_count) for h in hunks] == [(10, 3, 10, 4), (20, 2, 21, 2)]
    check_hunk_order(hunks, "good")


@pytest.mark.parametrize(
    "bad, message",
    [
        (_GOOD.replace("@@ -10,3 +10,4 @@", "@@ -10,3 +10,5 @@"), "counts 3 old / 5 new"),
        (_GOOD.replace("@@ -10,3 +10,4 @@", "@@ -10,2 +10,3 @@"), "more body lines"),
        (_GOOD.replace(" f\n", "?f\n"), "counts 2 old / 2 new"),
        (_GOOD.replace("+++ b/x.py", "+++ b/y.py"), "'+++ b/x.py'"),
        ("just text\n", "no hunk"),
    ],
)
def test_parser_rejects_malformed_hunks(bad, message):
    with pytest.raises(PatchFormatError, match=re.escape(message)):
        parse_patch(bad)


def test_hunk_order_rejects_a_wrong_new_start():
    with pytest.raises(PatchFormatError, match="new start 20, expected 21"):
        check_hunk_order(parse_patch(_GOOD.replace("@@ -20,2 +21,2 @@", "@@ -20,2 +20,2 @@")), "bad")


def test_order_check_catches_the_failure_of_issue_27(parsed, monkeypatch):
    """The shipped order passes; the other order, or a second patch written against the pristine
    file, or one touching the first's lines (the 31f1ca96 failure at actor.py:563), is refused."""
    first, second = "miles-31f1ca96-length-decay.patch", "miles-31f1ca96-global-mis-normalizer.patch"
    check_script_order([first, second], parsed)
    with pytest.raises(PatchFormatError, match="lands at 567"):
        check_script_order([second, first], parsed)
    monkeypatch.setitem(VERIFIED_BASE_RANGES, second, [("miles/backends/megatron_utils/actor.py", 565, 4)])
    with pytest.raises(PatchFormatError, match="touches base lines 563-566"):
        check_script_order([first, second], parsed)
