"""The docs stand alone: every figure README.md and docs/ claim is a row of BENCHMARKS.md's results table, with the
figures that row gives, each row says where and how it was measured, and no tracked file cites a work log or a path
outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLAIM = re.compile(r"\[([a-z0-9][a-z0-9-]*)\]\[bench\]")  # a claimed figure: [row-id][bench]
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
SECTION_LINK = re.compile(r"\]\(#([^)\s]+)\)")
COMMAND = re.compile(r"`(?:\.venv/bin/|python3? |bash |make )[^`]+`")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
WORK_LOG = re.compile(r"\bsessions? \d+|\.\./shared", re.I)
COLUMNS = ["id", "figure", "compared against", "machine", "date", "command or section"]
FIGURE = re.compile(r"(?<![\w.`])[+-]?\d+\.\d+(?![\w.`])")  # a decimal figure (not a version, path or name)
CLAUSE_ENDS = (". ", ".\n", "; ", ";\n", "\n\n", "[bench]")
"""Where the clause that claims a row's figures begins, looking back from its link."""
ROW_LIMIT = 300
"""A results row's characters at most: its current figure, with the section telling the rest (issue 71.5); superseded
figures live in git."""


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def results_table(benchmarks: str) -> list[dict[str, str]]:
    """The rows of the first table after BENCHMARKS.md's `## Results` heading, by column name."""
    lines = benchmarks[benchmarks.index("\n## Results\n"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, rows = table[0], table[2:]
    assert header == COLUMNS, header
    return [dict(zip(header, row, strict=True)) for row in rows]


def claim_problems(docs: dict[str, str], benchmarks: str) -> list[str]:
    """What breaks the link between the docs' claimed figures and BENCHMARKS.md's results table (empty: nothing).

    ``docs``: each Markdown file's path relative to the repository and its text."""
    if "\n## Results\n" not in benchmarks:
        return ["BENCHMARKS.md has no `## Results` table"]
    problems = []
    anchors = {anchor(heading) for heading in HEADING.findall(benchmarks)}
    rows = results_table(benchmarks)
    ids = [row["id"].strip("`") for row in rows]
    problems += [f"row {label} appears twice" for label in sorted({i for i in ids if ids.count(i) > 1})]
    lengths = {line.split("|")[1].strip().strip("`"): len(line) for line in benchmarks.splitlines()
               if line.startswith("| `")}
    for label, row in zip(ids, rows, strict=True):
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", label):
            problems.append(f"row id {label!r} is not a label")
        if lengths.get(label, 0) >= ROW_LIMIT:
            problems.append(f"row {label} is {lengths[label]} characters: give its current figure in under "
                            f"{ROW_LIMIT}, the rest in its section")
        problems += [f"row {label} has no {column}" for column in COLUMNS[1:4] if not row[column]]
        if not DATE.search(row["date"]):
            problems.append(f"row {label} has no date")
        where = row["command or section"]
        links = SECTION_LINK.findall(where)
        problems += [f"row {label} links to #{link}, which is no heading" for link in links if link not in anchors]
        if not links and not COMMAND.search(where):
            problems.append(f"row {label} gives neither a command nor a section")
    claimed = set()
    for path, text in docs.items():
        labels = CLAIM.findall(text)
        claimed.update(labels)
        problems += [f"{path} claims {label}, which is no row of BENCHMARKS.md's results" for label in labels
                     if label not in ids]
        problems += figure_problems(path, text, {label: row for label, row in zip(ids, rows, strict=True)})
        target = ("../" * path.count("/")) + "BENCHMARKS.md#results"
        if labels and f"\n[bench]: {target}\n" not in f"\n{text}\n":
            problems.append(f"{path} claims figures but does not define [bench]: {target}")
    problems += [f"row {label} is claimed by no document" for label in ids if label not in claimed]
    if not CLAIM.search(docs.get("README.md", "")):
        problems.append("README.md claims no figure")
    return problems


def figure_problems(path: str, text: str, rows: dict[str, dict[str, str]]) -> list[str]:
    """Decimal figures a document states in the clause that links a row but that the row does not give (its figure
    or what it is compared against), to the claim's precision: a claim that drifted from its measurement."""
    problems = []
    for claim in CLAIM.finditer(text):
        row = rows.get(claim.group(1))
        if row is None:
            continue
        start = max(text.rfind(end, 0, claim.start()) + len(end) for end in CLAUSE_ENDS)
        given = [float(value) for value in FIGURE.findall(row["figure"] + " " + row["compared against"])]
        for figure in FIGURE.findall(text[start:claim.start()]):
            digits = len(figure.split(".")[1])
            if not any(round(abs(value), digits) == abs(float(figure)) for value in given):
                problems.append(f"{path} claims {figure} beside [{claim.group(1)}], which its row does not give")
    return problems


def undated_sections(benchmarks: str) -> list[str]:
    """BENCHMARKS.md's sections (after the results table) without a date in their heading or first line."""
    lines, undated = benchmarks.splitlines(), []
    for i, line in enumerate(lines):
        if re.match(r"#{2,3} ", line) and line != "## Results":
            first = next((text for text in lines[i + 1:] if text.strip()), "")
            if not DATE.search(line) and not DATE.search(first):
                undated.append(line)
    return undated


def _docs() -> dict[str, str]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(path.relative_to(ROOT)): path.read_text() for path in paths}


def _benchmarks() -> str:
    return (ROOT / "BENCHMARKS.md").read_text()


def test_every_claimed_figure_is_a_row_with_its_section() -> None:
    assert claim_problems(_docs(), _benchmarks()) == []


def test_a_missing_row_or_section_fails() -> None:
    docs, benchmarks = _docs(), _benchmarks()
    label = CLAIM.findall(docs["README.md"])[0]
    row = next(line for line in benchmarks.splitlines() if line.startswith(f"| `{label}` |"))
    without_row = benchmarks.replace(row + "\n", "")
    assert f"README.md claims {label}, which is no row of BENCHMARKS.md's results" in claim_problems(docs, without_row)
    link = SECTION_LINK.search(row).group(1)
    heading = next(h for h in HEADING.findall(benchmarks) if anchor(h) == link)
    without_section = benchmarks.replace(f"## {heading}\n", "## Something else\n")
    assert f"row {label} links to #{link}, which is no heading" in claim_problems(docs, without_section)
    undated = benchmarks.replace(row, re.sub(r"20\d\d-\d\d-\d\d", "once", row))
    assert f"row {label} has no date" in claim_problems(docs, undated)
    padded = row.replace(" | ", " | " + "and more history " * 20, 1)
    assert f"row {label} is {len(padded)} characters" in " ".join(claim_problems(docs, benchmarks.replace(row, padded)))
    drifted = {**docs, "README.md": docs["README.md"].replace(f"[{label}][bench]", f"99.25 [{label}][bench]", 1)}
    assert f"README.md claims 99.25 beside [{label}], which its row does not give" in claim_problems(drifted,
                                                                                                    benchmarks)
    unclaimed = {path: text.replace(f"[{label}][bench]", "") for path, text in docs.items()}
    assert f"row {label} is claimed by no document" in claim_problems(unclaimed, benchmarks)


def test_every_benchmark_section_is_dated() -> None:
    benchmarks = _benchmarks()
    assert undated_sections(benchmarks) == []
    assert undated_sections(benchmarks + "\n## A new measurement\n\nIt ran.\n") == ["## A new measurement"]


def test_no_tracked_file_cites_a_work_log_or_a_path_outside_the_repository() -> None:
    assert WORK_LOG.search("as Session 12 found") and WORK_LOG.search("see ../shared/notes.md")
    assert not WORK_LOG.search("scope='session', a session of 3 steps")
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    hits = []
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = ROOT / name
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if WORK_LOG.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:100]}")
    assert hits == []


def test_engine_comments_leave_figures_to_the_benchmarks() -> None:
    # Measured figures live in BENCHMARKS.md and are cited from docs/; at most two engine modules may point there.
    citing = [str(path.relative_to(ROOT)) for path in (ROOT / "marl_pipeline").rglob("*.py")
              if "BENCHMARKS" in path.read_text()]
    assert len(citing) <= 2, citing
