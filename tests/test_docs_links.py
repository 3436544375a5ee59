"""Every ``docs/spec.md#anchor`` cited in the repository names a section or an ``<a id>`` of docs/spec.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "docs" / "spec.md"
THIS = "tests/test_docs_links.py"


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped (hyphens kept), spaces -> hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def spec_anchors() -> set[str]:
    text = SPEC.read_text()
    headings = {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}
    return headings | set(re.findall(r'<a id="([\w-]+)"></a>', text))


def cited_anchors() -> dict[str, list[str]]:
    """anchor -> ``path:line`` of each citation (``spec.md#a`` and the ``, #b`` that follow it on the line)."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    cited: dict[str, list[str]] = {}
    for rel in files + ["docs/spec.md"]:
        if not rel.endswith((".py", ".md", ".sh", ".yaml")) or rel.startswith("docs/results/") or rel == THIS:
            continue
        for no, line in enumerate((REPO / rel).read_text().splitlines(), start=1):
            for match in re.finditer(r"spec\.md(#[\w-]+(?:,? #[\w-]+)*)", line):
                for anchor in re.findall(r"#([\w-]+)", match.group(1)):
                    cited.setdefault(anchor, []).append(f"{rel}:{no}")
            for anchor in re.findall(r"\]\(#([\w-]+)\)", line) if rel == "docs/spec.md" else []:
                cited.setdefault(anchor, []).append(f"{rel}:{no}")
    return cited


def test_slug_follows_github():
    assert _slug("KL, entropy and clipping") == "kl-entropy-and-clipping"
    assert _slug("RULER-HotpotQA") == "ruler-hotpotqa"
    assert _slug("Multi-Conv GRPO") == "multi-conv-grpo"


def test_every_spec_citation_resolves():
    anchors, cited = spec_anchors(), cited_anchors()
    assert len(cited) >= 20  # the code cites the spec widely; an empty scan means the pattern broke
    missing = {a: where for a, where in cited.items() if a not in anchors}
    assert not missing, f"docs/spec.md has no section or <a id> for: {missing}"
