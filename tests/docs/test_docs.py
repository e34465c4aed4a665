"""The docs against the code: every setting documented with its variable and default, every relative link (and its
anchor) leading somewhere, and a README short enough to stay an introduction."""
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from app.settings import ServerSettings
from engine.config import EngineConfig
from engine.hardware import CAPABILITY_MASK_ENV

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MOST_LINES = 220
# Variables read outside the two dataclasses that configuration.md may list in its tables.
OTHER_VARIABLES = {CAPABILITY_MASK_ENV, "LOCKSTEP_URL"}

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")


def variable_of(name: str) -> str:
    """The variable a settings field is read from (engine/config.py's dataclass_from_env)."""
    return f"LOCKSTEP_{name.upper()}"


def settings_fields():
    return [pytest.param(cls, f, id=f"{cls.__name__}.{f.name}") for cls in (EngineConfig, ServerSettings)
            for f in fields(cls)]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, code spans kept (headings keep their code in their anchors)."""
    lines, in_fence = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", "")).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for _, line in prose_lines(path):
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in prose_lines(path):
        for target in LINK.findall(CODE_SPAN.sub("``", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:...
                links.append((number, target))
    return links


def table_rows(path: Path) -> dict[str, list[str]]:
    """Each table row of `path` that names one LOCKSTEP_ variable in a cell of its own: variable -> its cells."""
    rows = {}
    for _, line in prose_lines(path):
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for index, cell in enumerate(cells):
            match = re.fullmatch(r"`(LOCKSTEP_[A-Z0-9_]+)`", cell)
            if match:
                rows[match.group(1)] = cells[index:]
                break
    return rows


@pytest.mark.parametrize(("cls", "setting"), settings_fields())
def test_every_setting_is_documented_with_its_variable(cls, setting):
    text = CONFIGURATION.read_text(encoding="utf-8")
    variable = variable_of(setting.name)
    assert f"`{variable}`" in text, (
        f"{cls.__name__}.{setting.name} is read from {variable}, which docs/configuration.md does not list: "
        "add a row for it (setting, env var, default, what it does)")
    assert variable in table_rows(CONFIGURATION), f"{variable} is named in docs/configuration.md but has no table row"


@pytest.mark.parametrize(("cls", "setting"), settings_fields())
def test_every_documented_default_is_the_code_default(cls, setting):
    """The default column's first code span is the value the field takes when its variable is unset."""
    default = setting.default if setting.default is not MISSING else setting.default_factory()
    if default in ("", ()):  # unset: the docs say what that means in words
        return
    cells = table_rows(CONFIGURATION)[variable_of(setting.name)]
    written = CODE_SPAN.search(cells[1])
    assert written, f"{variable_of(setting.name)}: the default column has no `value`: {cells[1]!r}"
    written = written.group()[1:-1]
    if isinstance(default, bool):
        assert written == str(default).lower(), f"{variable_of(setting.name)}: documented {written}, code {default}"
    elif isinstance(default, (int, float)):
        assert float(written.replace(",", "").replace("_", "")) == default, (
            f"{variable_of(setting.name)}: documented {written}, code {default}")
    else:
        assert written == default, f"{variable_of(setting.name)}: documented {written!r}, code {default!r}"


def test_every_documented_variable_is_read_by_the_code():
    known = {variable_of(f.name) for cls in (EngineConfig, ServerSettings) for f in fields(cls)} | OTHER_VARIABLES
    stale = sorted(set(table_rows(CONFIGURATION)) - known)
    assert not stale, f"docs/configuration.md documents settings the code no longer reads: {stale}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_its_anchor(document):
    broken = []
    for number, target in relative_links(document):
        path_part, _, anchor = target.partition("#")
        linked = (document.parent / path_part).resolve() if path_part else document
        if not linked.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"line {number}: {target} (no heading #{anchor} in {linked.name})")
    assert not broken, f"{document.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_doc():
    linked = {target.partition("#")[0] for _, target in relative_links(README)}
    missing = [f"docs/{path.name}" for path in DOCUMENTS[1:] if f"docs/{path.name}" not in linked]
    assert not missing, f"README.md's Documentation list lacks {missing}"


def test_the_readme_stays_an_introduction():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MOST_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MOST_LINES}): move reference material to docs/")


def test_the_link_checker_sees_a_broken_link(tmp_path):
    """The checks above can fail: a missing file and a missing anchor are both found."""
    (tmp_path / "a.md").write_text("# Title\n\n[ok](#title) [gone](b.md) [nowhere](#missing)\n"
                                   "```\n[in code](ignored.md)\n```\n", encoding="utf-8")
    targets = [target for _, target in relative_links(tmp_path / "a.md")]
    assert targets == ["#title", "b.md", "#missing"]
    assert anchors(tmp_path / "a.md") == {"title"}


@pytest.mark.parametrize(("heading", "anchor"), [
    ("WebSocket `/ws`", "websocket-ws"),
    ("`POST /v1/chat/completions`", "post-v1chatcompletions"),
    ("Lockstep's own CPU kernels", "locksteps-own-cpu-kernels"),
    ("Why lockstep owns them: what they were measured against",
     "why-lockstep-owns-them-what-they-were-measured-against"),
    ("`GET /`: the chat page", "get--the-chat-page"),
    ("`POST /basic_generate`", "post-basic_generate"),
])
def test_anchors_are_the_ones_github_makes(heading, anchor):
    assert slug(heading) == anchor
