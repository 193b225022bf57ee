"""Every document path the code and docs point a reader at exists (issue 9, defect 6)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A relative path to a Markdown file, e.g. docs/alerts.md.
_DOC_REF = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w.-]+\.md)\b")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / p for p in out]


def test_every_referenced_document_exists() -> None:
    missing = []
    for path in _tracked_text_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for ref in _DOC_REF.findall(line):
                if ref.startswith(("http", "shared/", "../")):
                    continue
                if not (ROOT / ref).exists() and not (path.parent / ref).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {ref}")
    assert not missing, "documents pointed at that do not exist:\n" + "\n".join(missing)
