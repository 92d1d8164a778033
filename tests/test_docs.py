"""The README stays a front page and docs/ describes the system as it is.

- README.md holds at most README_MAX_LINES lines and the two set-up commands, the second of
  them also in .ci/run (which runs it);
- README.md and every page under docs/ hold no diary wording (DIARY): a figure carries its
  date, machine and command, and prose does not say when or in which sitting it was written;
- every relative link in them points to a file that exists;
- where mkdocs is installed (the `docs` extra; .ci/run installs it) the site builds with
  --strict, which also checks the anchors of links between pages.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 260
SETUP_COMMANDS = ('pip install -e . && pdserve up', 'pip install -e ".[test]" && python -m pytest')

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
             "twelfth|thirteenth|fourteenth|fifteenth|\\d+(?:st|nd|rd|th)")
# Phrases that date prose by when it was written rather than what it measured. "session" on
# its own stays allowed: the KV transfer has a session object.
DIARY = re.compile(
    rf"""\b(?:this|that|last|next|previous|earlier|later|same|one|another|{_ORDINALS})
             \ (?:session|sitting)s?\b
       | \b(?:today|yesterday|tonight)\b
       | \bthis\ (?:morning|afternoon|evening)\b
       | \b(?:earlier|later)\ (?:the\ same|that)\ day\b
       | \bwe\ (?:then|now|next|first|tried|found|measured|ran|saw)\b
       | \b(?:last|next)\ (?:card\ )?run\b
       | \bthis\ (?:change|work|tree)\b
       | \bnot\ re-measured\b
    """,
    re.IGNORECASE | re.VERBOSE,
)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (commands, identifiers)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def relative_links(text: str) -> list[str]:
    """Link and image targets that point into the repository, without their anchors."""
    targets = []
    for target in _LINK.findall(prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http:, https:, mailto: ..., or an anchor on the same page
        targets.append(target.split("#", 1)[0])
    return targets


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to docs/")


def test_readme_keeps_the_setup_commands_and_ci_runs_the_test_command():
    text = README.read_text()
    for command in SETUP_COMMANDS:
        assert f"```sh\n{command}\n```" in text, command
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(SETUP_COMMANDS[1])}$", ci, re.MULTILINE), \
        ".ci/run runs the README's test command as written"


def test_docs_exist():
    assert (REPO / "mkdocs.yml").is_file()
    assert (DOCS / "index.md").is_file() and (DOCS / "benchmarks.md").is_file()


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_diary_wording(page: Path):
    found = [(number, m.group(0))
             for number, line in enumerate(prose(page.read_text()).splitlines(), 1)
             for m in DIARY.finditer(line)]
    assert not found, f"{page.relative_to(REPO)}: diary wording (date the figure instead): {found}"


@pytest.mark.parametrize("sample", [
    "Measured in this session on the Zen 4.",
    "The ninth session's figures are from another lease.",
    "In the second sitting the load had dropped.",
    "Earlier the same day, single runs made 1,150 tokens/s.",
    "Fixed today; not re-measured for lack of time.",
    "We then tried a histogram.",
    "The next card run measures it.",
    "Before this change the step took 9 ms.",
])
def test_diary_check_catches_diary_wording(sample: str):
    assert DIARY.search(sample), sample


@pytest.mark.parametrize("sample", [
    "Zen 4, 2026-11-27, commit 09e3fa3: `pdserve bench --workload multi-turn`.",
    "The session thread's wake-up and the snapshot's event.",
    "A send session ships each layer while the next one computes.",
    "Two single-round runs of the same command on the same day.",
    "Each figure names its date, machine and command.",
])
def test_diary_check_passes_descriptions(sample: str):
    assert not DIARY.search(sample), sample


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files(page: Path):
    missing = [target for target in relative_links(page.read_text())
               if not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing files: {missing}"


def test_link_check_finds_links_outside_code():
    text = "See [a](docs/a.md#x), ![b](img.png) and [c](https://x.org).\n`[d](no.md)`\n"
    assert relative_links(text) == ["docs/a.md", "img.png"]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')")
def test_mkdocs_builds_strict(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "index.html").is_file()
