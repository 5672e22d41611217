"""`bench/readme.py [--check]`: copies the measured tables from bench/results/ into README.md
and docs/benchmarks.md.

Their benchmark figures are not typed in: each block of them sits between

    <!-- bench/readme.py: FILE[#PART] -->
    ...
    <!-- bench/readme.py: end -->

and this replaces the block's body with that file of bench/results/ (`summary.md`, written by
`make bench`, is cut into parts at its `<!-- part: NAME -->` lines; `callgrind.md`, written by
bench/callgrind.py, is one part). Run it after `make bench` and bench/callgrind.py. With
`--check` it changes nothing and exits 1 when either file differs from the results.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
PAGES = [README, HERE.parent / "docs" / "benchmarks.md"]  # each has blocks
BLOCK = re.compile(r"(<!-- bench/readme\.py: (?P<src>[^ #]+)(?:#(?P<part>[^>]+?))? -->\n)"
                   r"(?P<body>.*?)"
                   r"(<!-- bench/readme\.py: end -->)", re.DOTALL)
PART = re.compile(r"^<!-- part: (.+?) -->\n", re.MULTILINE)


def parts(text: str) -> dict[str, str]:
    """The parts of a results file, by name; a file without part markers is the part ''."""
    found = list(PART.finditer(text))
    if not found:
        return {"": text.strip("\n")}
    return {m.group(1): text[m.end():(found[i + 1].start() if i + 1 < len(found)
                                      else len(text))].strip("\n")
            for i, m in enumerate(found)}


def spliced(readme: str) -> str:
    cache: dict[str, dict[str, str]] = {}

    def body(m: re.Match) -> str:
        src, part = m.group("src"), m.group("part") or ""
        if src not in cache:
            cache[src] = parts((RESULTS / src).read_text())
        if part not in cache[src]:
            raise SystemExit(f"bench/results/{src} has no part {part!r} "
                             f"(it has {sorted(cache[src])}): run make bench again")
        # Blank lines around the body: a table or a paragraph never runs into a marker.
        return m.group(1) + "\n" + cache[src][part] + "\n\n" + m.group(5)

    out, n = BLOCK.subn(body, readme)
    if not n:
        raise SystemExit("a page has no bench/readme.py blocks")
    return out


def main() -> int:
    differ = []
    for page in PAGES:
        name = page.relative_to(HERE.parent)
        text = page.read_text()
        new = spliced(text)
        if new == text:
            continue
        if "--check" in sys.argv[1:]:
            print(f"{name}'s benchmark blocks differ from bench/results/: run bench/readme.py")
            differ.append(name)
        else:
            page.write_text(new)
            print(f"{name}: benchmark blocks copied from bench/results/")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
