"""Writes docs/modules.md, the module map: each module of the engine, the Dagster layer and the shipped environments
with the first sentence of its docstring, so the map is the code's own word (tests/test_architecture.py checks it is
current).

    .venv/bin/python scripts/module_map.py
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("marl_pipeline", "assets", "resources", "environments")
OUT = ROOT / "docs" / "modules.md"
LONGEST = 240
"""Characters of a module's sentence shown at most."""


def first_sentence(path: Path) -> str:
    """The first sentence of the module's docstring, on one line ("" without one)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    found = re.match(r"(.+?(?<!\bDr)(?<!\bal)(?<!e\.g)(?<!i\.e)(?<!\bvs)\.)(\s+[A-Z(`]|$)", paragraph)
    sentence = found.group(1) if found else paragraph
    if len(sentence) > LONGEST:  # the rest is the module's to tell
        sentence = sentence[:LONGEST].rsplit(" ", 1)[0] + " ..."
    return sentence.replace("|", "\\|")


def module_map() -> str:
    lines = ["# Module map", "", "Generated from each module's docstring by `scripts/module_map.py`; the design is "
             "docs/ARCHITECTURE.md.", ""]
    for package in PACKAGES:
        lines += [f"## `{package}/`", "", "| module | what it is |", "| --- | --- |"]
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts or (path.name == "__init__.py" and not first_sentence(path)):
                continue
            name = str(path.relative_to(ROOT / package))
            lines.append(f"| `{name}` | {first_sentence(path)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    OUT.write_text(module_map())
    print(f"wrote {OUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
