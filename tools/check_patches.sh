#!/usr/bin/env bash
# Check megatron-mis' host patches against a real slime or Miles checkout (needs git and python3).
#
#   tools/check_patches.sh HOST_DIR
#
# HOST_DIR is a checkout of slime (has slime/) or Miles (has miles/) at the commit the patch names
# carry (patches/<host>-<commit>-*.patch; a different HEAD is an error unless ALLOW_OTHER_COMMIT=1).
# HOST_DIR is never modified: every patch is applied to a copy of the files it touches.
#   1. each patch alone, on the pristine files, with `git apply -v`: prints where each hunk lands
#      (the base line, i.e. the header's line corrected by git's reported offset) as the rows of
#      VERIFIED_BASE_RANGES in tests/unit/test_patches.py, and fails when they differ from it;
#   2. every example script (examples/<host>/*.sh), its patches in the order the script names them,
#      applied one after the other with `git apply -v`: fails when one does not apply, or when git
#      has to shift a hunk (the line numbers must count the lines the earlier patches added).
# Exit status 0 when everything applies as recorded, 1 otherwise.
set -euo pipefail
if [ "$#" -ne 1 ] || [ ! -d "$1" ]; then
    echo "usage: $0 HOST_DIR   (a slime or Miles checkout)" >&2
    exit 2
fi
REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
exec python3 - "$REPO" "$(cd -- "$1" && pwd)" <<'PY'
import ast, re, shutil, subprocess, sys, tempfile
from pathlib import Path

repo, host_dir = Path(sys.argv[1]), Path(sys.argv[2])
host = "miles" if (host_dir / "miles").is_dir() else "slime" if (host_dir / "slime").is_dir() else None
if host is None:
    sys.exit(f"error: {host_dir} holds neither slime/ nor miles/")
patches = sorted((repo / "patches").glob(f"{host}-*.patch"))
if not patches:
    sys.exit(f"error: no patches/{host}-*.patch")
commit = patches[0].name.split("-")[1]
head = subprocess.run(["git", "-C", str(host_dir), "rev-parse", "HEAD"], capture_output=True, text=True)
if head.returncode == 0 and not head.stdout.startswith(commit):
    msg = f"{host_dir} is at {head.stdout.strip()}, the patches are for {host} {commit}"
    if __import__("os").environ.get("ALLOW_OTHER_COMMIT") != "1":
        sys.exit(f"error: {msg} (set ALLOW_OTHER_COMMIT=1 to check anyway)")
    print(f"warning: {msg}")

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")


def hunks(patch):
    """[(file, old_start, old_count)] in the patch's order."""
    out, path = [], None
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            path = line[6:]
        elif (m := HUNK.match(line)):
            out.append((path, int(m[1]), int(m[2] or 1)))
    return out


def apply(workdir, patch):
    """git apply -v in workdir; returns (ok, {hunk_number: offset}, output)."""
    res = subprocess.run(["git", "apply", "-v", str(patch)], cwd=workdir, capture_output=True, text=True)
    text = res.stdout + res.stderr
    offsets = {int(n): int(o) for n, o in re.findall(r"Hunk #(\d+) succeeded at \d+ \(offset (-?\d+) lines?\)", text)}
    return res.returncode == 0, offsets, text


def fresh_copy(files):
    tmp = Path(tempfile.mkdtemp(prefix="check_patches_"))
    for f in files:
        (tmp / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(host_dir / f, tmp / f)
    return tmp


test_src = (repo / "tests/unit/test_patches.py").read_text()
recorded = ast.literal_eval(re.search(r"VERIFIED_BASE_RANGES = (\{.*?\n\})", test_src, re.S)[1])
failed = False
print(f"# {host} at {host_dir}: each patch alone (rows of VERIFIED_BASE_RANGES)")
for patch in patches:
    hs = hunks(patch)
    tmp = fresh_copy({f for f, _, _ in hs})
    try:
        ok, offsets, text = apply(tmp, patch)
    finally:
        shutil.rmtree(tmp)
    if not ok:
        print(f"FAIL {patch.name} does not apply on its own:\n{text}")
        failed = True
        continue
    # git numbers hunks per file; re-number them the same way
    rows, per_file = [], {}
    for f, start, count in hs:
        per_file[f] = per_file.get(f, 0) + 1
        rows.append((f, start + offsets.get(per_file[f], 0), count))
    print(f'    "{patch.name}": {rows!r},')
    if recorded.get(patch.name) != rows:
        print(f"FAIL {patch.name}: recorded {recorded.get(patch.name)!r}")
        failed = True

for script in sorted((repo / "examples" / host).glob("*.sh")):
    names = list(dict.fromkeys(re.findall(r"patches/([\w.-]+\.patch)", script.read_text())))
    if not names:
        continue
    files = {f for n in names for f, _, _ in hunks(repo / "patches" / n)}
    tmp = fresh_copy(files)
    try:
        for n in names:
            ok, offsets, text = apply(tmp, repo / "patches" / n)
            status = "ok" if ok and not offsets else "FAIL"
            failed |= status == "FAIL"
            print(f"{status} {script.relative_to(repo)}: {n}" + ("" if ok and not offsets else f"\n{text}"))
    finally:
        shutil.rmtree(tmp)
sys.exit(1 if failed else 0)
PY
