#!/usr/bin/env python3
"""`make layers`: src/'s modules depend one way, as the floors at the head of src/lib.rs say.

Reads src/**/*.rs (no build), finds which top-level module of src/ each file uses (`crate::x`,
`use crate::{...}`, `super::` resolved upward, `$crate::x` in macros, and macros by name), and
fails, naming the cycle or the upward edge, when a module uses one on its own floor or above.
The same is checked inside src/shmem/, against the file order at the head of src/shmem/mod.rs;
there `super::X` resolves through mod.rs's re-exports to the file defining X, and mod.rs's own
items (the pinned handle `Cap`, whose impls are split across the files on purpose) are left out.

The floors are parsed from the doc comment that lists them, so the doc and the check are one:
lines `//! N. `a`, `b`: what the floor holds ...` (bottom first); the module names are the
backticked names before the line's first colon. Usage: layers.py [SRC_DIR] [--graph].
"""

import re
import sys
from pathlib import Path

TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<line_comment>//[^\n]*)
  | (?P<block_comment>/\*)
  | (?P<raw_string>b?r(?P<hashes>\#*)")
  | (?P<string>b?"(?:\\.|[^"\\])*")
  | (?P<char>b?'(?:\\.|[^\\'\n])')
  | (?P<ident>\$?[A-Za-z_][A-Za-z0-9_]*)
  | (?P<path_sep>::)
  | (?P<punct>.)
    """,
    re.VERBOSE | re.DOTALL,
)


def tokens(text):
    """(kind, value, line) for identifiers, `::` and punctuation; comments and literals dropped."""
    pos, line, out = 0, 1, []
    while pos < len(text):
        m = TOKEN.match(text, pos)
        kind = m.lastgroup if m.lastgroup != "hashes" else "raw_string"
        end = m.end()
        if m.group("block_comment"):
            depth, end = 1, m.end()
            while depth and end < len(text):
                if text.startswith("/*", end):
                    depth, end = depth + 1, end + 2
                elif text.startswith("*/", end):
                    depth, end = depth - 1, end + 2
                else:
                    end += 1
            kind = "block_comment"
        elif m.group("raw_string") is not None:
            close = '"' + m.group("hashes")
            end = text.find(close, m.end())
            end = len(text) if end < 0 else end + len(close)
            kind = "raw_string"
        if kind in ("ident", "path_sep", "punct"):
            out.append((kind, m.group(kind), line))
        line += text.count("\n", pos, end)
        pos = end
    return out


def use_tree(toks, i):
    """Parses a path or use tree at toks[i]: (list of segment lists, index after it)."""
    segs = []
    while i < len(toks):
        kind, val, _ = toks[i]
        if kind == "ident":
            segs.append(val)
            i += 1
            if i < len(toks) and toks[i][0] == "path_sep":
                i += 1
                continue
            return [segs], i
        if val == "{":
            paths, i = [], i + 1
            while i < len(toks) and toks[i][1] != "}":
                if toks[i][1] == ",":
                    i += 1
                    continue
                sub, i = use_tree(toks, i)
                paths += [segs + s for s in sub]
            return paths or [segs], i + 1
        if val == "*":
            return [segs], i + 1
        break
    return [segs], i


class File:
    def __init__(self, src, path):
        self.path = path
        rel = path.relative_to(src).with_suffix("").parts
        self.module = [p for p in rel if p not in ("mod", "lib")]
        self.rel = str(path.relative_to(src.parent))
        self.toks = tokens(path.read_text())
        self.uses = []  # (absolute path from the crate root, line)
        self.macros_defined = set()
        self.macros_called = []  # (name, line)
        self._walk()

    def _walk(self):
        toks, stack, depth, i = self.toks, [], 0, 0
        while i < len(toks):
            kind, val, line = toks[i]
            nxt = toks[i + 1] if i + 1 < len(toks) else (None, None, 0)
            if val == "{":
                depth += 1
            elif val == "}":
                depth -= 1
                if stack and stack[-1][1] == depth:
                    stack.pop()
            elif val == "mod" and nxt[0] == "ident" and i + 2 < len(toks) and toks[i + 2][1] == "{":
                stack.append((nxt[1], depth))  # an inline module: `super` within it is this file
                i += 1
            elif kind == "ident" and val == "macro_rules" and nxt[1] == "!":
                self.macros_defined.add(toks[i + 2][1])
                i += 3
                continue
            elif kind == "ident" and nxt[1] == "!" and val not in ("macro_rules",):
                self.macros_called.append((val, line))
            elif kind == "ident" and val in ("crate", "$crate", "super", "self") and (
                nxt[0] == "path_sep"
            ):
                prev = toks[i - 1] if i else (None, None, 0)
                if prev[0] == "path_sep":  # the middle of a path already read (super::super)
                    i += 1
                    continue
                here = self.module + [name for name, _ in stack]
                for segs in use_tree(toks, i)[0]:
                    absolute = self._resolve(here, segs)
                    if absolute is not None:
                        self.uses.append((absolute, line))
                i = use_tree(toks, i)[1]
                continue
            i += 1

    @staticmethod
    def _resolve(here, segs):
        if segs[0] in ("crate", "$crate"):
            return segs[1:]
        base = list(here)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                if not base:
                    return None
                base.pop()
            segs = segs[1:]
        return base + segs


def read_floors(path, what):
    """[(floor number, [names], line)] from `//! N. `a`, `b`: ...` lines of path's head."""
    floors = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"//!\s*(\d+)\.\s+(.*)", text)
        if m:
            head = m.group(2).split(":", 1)[0]
            names = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", head)
            if names:
                floors.append((int(m.group(1)), names, n))
        elif not text.startswith("//!") and text.strip():
            break
    if not floors:
        sys.exit(f"layers: no floor list (`//! 1. `module`: ...`) at the head of {path} ({what})")
    return floors


def check(edges, floors, where, what):
    """Problems (strings) with edges {(a, b): (file, line)} against floors."""
    problems = []
    floor_of = {}
    for number, names, line in floors:
        for name in names:
            if name in floor_of:
                problems.append(f"{where}:{line}: `{name}` is listed on two floors")
            floor_of[name] = number
    nodes = sorted({a for a, _ in edges} | {b for _, b in edges})
    for node in nodes:
        if node not in floor_of:
            problems.append(f"{where}: {what} `{node}` is on no floor of its list")
    for cycle, knot in cycles(edges):
        steps = "; ".join(
            f"{a} -> {b} at {edges[a, b][0]}:{edges[a, b][1]}"
            for a, b in zip(cycle, cycle[1:] + cycle[:1])
        )
        whole = f" (one knot of {len(knot)}: {', '.join(knot)})" if len(knot) > len(cycle) else ""
        problems.append(
            f"cycle among {what}s: {' -> '.join(cycle + [cycle[0]])}{whole}: {steps}"
        )
    for (a, b), (file, line) in sorted(edges.items()):
        if a in floor_of and b in floor_of and floor_of[b] >= floor_of[a]:
            rel = "its own" if floor_of[a] == floor_of[b] else "a higher"
            problems.append(
                f"{file}:{line}: upward edge: {what} `{a}` (floor {floor_of[a]}) uses `{b}`, "
                f"on {rel} floor ({floor_of[b]})"
            )
    return problems


def cycles(edges):
    """One cycle through each strongly connected component of more than one node (Tarjan)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for comp in comps:
        # The shortest cycle through the component's first node (breadth-first), named; the
        # whole knot is named too when it is larger than that cycle.
        start, members = comp[0], set(comp)
        prev, queue, cycle = {start: None}, [start], None
        while queue and cycle is None:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    cycle = [v]
                    while prev[cycle[-1]] is not None:
                        cycle.append(prev[cycle[-1]])
                    cycle.reverse()
                    break
                if w in members and w not in prev:
                    prev[w] = v
                    queue.append(w)
        found.append((cycle, comp))
    return found


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    src = Path(args[0] if args else Path(__file__).resolve().parent.parent / "src")
    files = [File(src, p) for p in sorted(src.rglob("*.rs"))]
    top_modules = {f.module[0] for f in files if f.module}
    macros = {}
    for f in files:
        for name in f.macros_defined:
            macros[name] = f.module[0] if f.module else None

    shmem_files = [f for f in files if f.module[:1] == ["shmem"]]
    shmem_root = next((f for f in shmem_files if len(f.module) == 1), None)
    shmem_children = {f.module[1] for f in shmem_files if len(f.module) == 2}
    exported = {}  # a name re-exported by shmem/mod.rs -> the file defining it
    if shmem_root:
        toks = shmem_root.toks
        for i, (kind, val, _) in enumerate(toks):
            if val == "use" and i + 1 < len(toks) and toks[i + 1][1] in shmem_children:
                for segs in use_tree(toks, i + 1)[0]:
                    if len(segs) >= 2:
                        exported[segs[-1]] = segs[0]

    top_edges, shmem_edges = {}, {}
    for f in files:
        # The crate root and the in-server tests may use everything.
        if not f.module or f.module[0] == "pg_tests":
            continue
        me = f.module[0]
        for absolute, line in f.uses:
            if absolute and absolute[0] in top_modules and absolute[0] != me:
                top_edges.setdefault((me, absolute[0]), (f.rel, line))
            if me == "shmem" and len(f.module) >= 2 and absolute[:1] == ["shmem"]:
                if len(absolute) < 2:
                    continue
                target = absolute[1] if absolute[1] in shmem_children else exported.get(absolute[1])
                if target and target != f.module[1]:
                    shmem_edges.setdefault((f.module[1], target), (f.rel, line))
        for name, line in f.macros_called:
            owner = macros.get(name)
            if owner and owner != me and owner in top_modules:
                top_edges.setdefault((me, owner), (f.rel, line))

    if "--graph" in argv:
        for (a, b), (file, line) in sorted(top_edges.items()):
            print(f"{a} -> {b}  ({file}:{line})")
        for (a, b), (file, line) in sorted(shmem_edges.items()):
            print(f"shmem/{a} -> shmem/{b}  ({file}:{line})")
        return 0

    lib = src / "lib.rs"
    floors = read_floors(lib, "src's modules")
    problems = check(top_edges, floors, "src/lib.rs", "module")
    listed = {n for _, names, _ in floors for n in names}
    for name in sorted(top_modules - listed - {"lib", "pg_tests"}):
        problems.append(f"src/lib.rs: module `{name}` is on no floor of its list")
    shmem_order = []
    if shmem_root:
        shmem_order = read_floors(shmem_root.path, "src/shmem's files")
        problems += check(shmem_edges, shmem_order, "src/shmem/mod.rs", "shmem file")
        listed = {n for _, names, _ in shmem_order for n in names}
        for name in sorted(shmem_children - listed):
            problems.append(f"src/shmem/mod.rs: file `{name}` is on no floor of its list")

    if problems:
        for p in problems:
            print(f"layers: {p}", file=sys.stderr)
        print(f"layers: FAILED ({len(problems)} problem(s))", file=sys.stderr)
        return 1
    print(
        f"layers: ok: {len(top_modules - {'lib', 'pg_tests'})} modules of src/ on {len(floors)} "
        f"floors, {len(top_edges)} uses, all downward; {len(shmem_children)} files of src/shmem/ "
        f"in {len(shmem_order)} steps, {len(shmem_edges)} uses, all downward"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
