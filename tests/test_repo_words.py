"""The repository speaks of the product, not of how it was built: no tracked file (nor a tracked file's
or folder's name) names numbered work periods, machine loans, numbered tracker items or stops, the
device tool's output folder, a checkout beside this one, or the folders carried to a device machine.
A comment or docstring says what it checks and why instead.

The patterns are built from pieces so that this file does not match them itself (the scan reads it
like any other tracked file)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_BYTES = 1_000_000  # larger files (data, recorded logs) are skipped

_S = "\\"  # a backslash, so that no pattern below is spelled out whole in this file
PATTERNS = {
    "numbered work period": _S + "bsessions? ?" + _S + "d",
    "machine loan": _S + "b" + "lea" + "se",
    "numbered issue": _S + "b" + "iss" + "ue[ #-]?#?" + _S + "d+",
    "numbered stop": _S + "b" + "st" + "op[ #-]?#?" + _S + "d+",
    "device output folder": _S + "$" + "OUT" + _S + "b",
    "checkout beside this one": _S + "." + _S + "./" + "sha" + "red",
    "carried folder": _S + ".gpu" + _S + "d",
    "carried folder name": _S + ".gpu[a-z]*/",
    "carry script": "make" + "_carry",
    "temporary checkout": "/tmp" + "/repo",
}
WORDS = re.compile("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(PATTERNS.values())), re.IGNORECASE)
NAMES = list(PATTERNS)


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, the line) for every match in text."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in WORDS.finditer(line):
            found.append((number, NAMES[int(m.lastgroup[1:])], line.strip()[:160]))
    return found


def test_patterns_match_what_they_name():
    """The scan's patterns catch each kind of word, and leave ordinary ones alone."""
    caught = ["in sess" + "ion 12 we", "Sess" + "ions3", "the lea" + "se ran out", "see iss" + "ue 31",
              "iss" + "ue #7", "the iss" + "ue-28 job", "st" + "op 4", "to $" + "OUT/x", "../" + "shared/STYLE.md", "." + "gpu34/x",
              "." + "gpuregen/x", "make" + "_carry.sh", "/tmp" + "/repo/x"]
    for line in caught:
        assert _hits(line), line
    for line in ["release the lock", "a session of training", "stop the job", "an issue with the data",
                 "shared memory", "OUTPUT", "$OUTPUT", ".gpu_info", "the GPU is free"]:
        assert not _hits(line), line


def test_no_tracked_file_names_process_words():
    """Every tracked text file under 1 MB, and every tracked path, is free of the patterns above; the
    failure lists every hit as path:line: [kind] text."""
    hits = []
    folders = set()
    for path in _tracked_files():
        hits += [f"{path}: [{kind}] (its name)" for _, kind, _ in _hits(Path(path).name)]
        folders.update(str(parent) for parent in Path(path).parents if str(parent) != ".")
        file = REPO / path
        if not file.is_file() or file.stat().st_size > MAX_BYTES:
            continue  # deleted in the work tree, a link to a folder, or too large to be prose
        data = file.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        hits += [f"{path}:{number}: [{kind}] {line}" for number, kind, line in _hits(text)]
    for folder in sorted(folders):  # each folder once, by its own name (a trailing / for the carried-folder pattern)
        hits += [f"{folder}/: [{kind}] (its name)" for _, kind, _ in _hits(Path(folder).name + "/")]
    assert not hits, f"{len(hits)} process words in tracked files (say what is checked and why instead):\n" + \
        "\n".join(hits)
