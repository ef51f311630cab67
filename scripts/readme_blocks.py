"""The fenced code blocks of README.md and the guides under docs/, and how each is checked
(standard library only).

Every fenced block of every page (``pages()``: README.md, then docs/*.md) must follow a marker
line ``<!-- readme-test: ... -->`` (the line right above the opening fence, invisible on
rendered pages) saying how it runs:

* ``python``: saved to a file and run with ``python file.py``;
* ``torchrun N``: saved to a file and run on N local processes with
  ``python -m torch.distributed.run --standalone --nproc-per-node N file.py`` (gloo on CPU);
* ``launch N``: the same through shardwise's own launcher, ``python -m shardwise.launch --nproc N file.py``;
* ``bash``: the commands, one per line, run by bash from the repository root;
* ``skip: <reason>``: not run (a fragment or a command that cannot run inside the tests);
  kept to a minimum, and the reason is printed by the test;
* ``text: <what it is>``: not code (a tree, a sample of printed output), never run; a test that
  reads it says so in the description.

Options after ``;``:

* ``ci``: ``.ci/run`` also runs the block exactly as written (pip commands included) in a fresh
  virtual environment installed as the README says, before the test suite (README.md only: the
  install check belongs to the front page);
* ``sub "A" -> "B"``: tests/test_readme.py runs the block with text A replaced by B (e.g. fewer
  training steps); the block must contain A. ``.ci/run`` runs it unchanged.

``python scripts/readme_blocks.py --ci-dir DIR`` writes each ``ci`` block to ``DIR/NN.sh`` for
``.ci/run``; ``python scripts/readme_blocks.py`` lists every block of every page with its marker.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
KINDS = ("python", "torchrun", "launch", "bash", "skip", "text")


def pages() -> list[str]:
    """README.md, then every docs/*.md page (paths relative to the repository root)."""
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md", *docs]


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language and code, and how it is checked."""

    line: int            # 1-based line of the opening fence
    lang: str
    code: str
    kind: str            # one of KINDS
    nproc: int = 1       # processes, for torchrun / launch
    reason: str = ""     # for skip and text
    ci: bool = False
    subs: tuple[tuple[str, str], ...] = ()
    page: str = "README.md"  # relative to the repository root

    @property
    def name(self) -> str:
        first = self.code.strip().splitlines()[0] if self.code.strip() else ""
        return f"{self.page}:{self.line} ({self.kind}{' ' + str(self.nproc) if self.kind in ('torchrun', 'launch') else ''}): {first[:70]}"

    def tested_code(self) -> str:
        """The code tests/test_readme.py runs: with the ``sub`` replacements."""
        code = self.code
        for old, new in self.subs:
            code = code.replace(old, new)
        return code


class MarkerError(ValueError):
    """A block without a marker, or a marker that does not parse."""


def _parse_marker(text: str, line: int, page: str = "README.md") -> dict:
    head, *options = [part.strip() for part in text.split(";")]
    kind, _, arg = head.partition(" ")
    kind = kind.rstrip(":")
    if kind not in KINDS:
        raise MarkerError(f"{page}:{line}: unknown readme-test kind {kind!r} in {text!r}; one of {KINDS}")
    out: dict = {"kind": kind}
    if kind in ("torchrun", "launch"):
        if not arg.strip().isdigit():
            raise MarkerError(f"{page}:{line}: {kind} needs a process count, got {text!r}")
        out["nproc"] = int(arg)
    if kind in ("skip", "text"):
        out["reason"] = head.partition(":")[2].strip()
        if not out["reason"]:
            raise MarkerError(f"{page}:{line}: a {kind} must say why: '{kind}: <why>'")
    subs = []
    for option in options:
        if option == "ci":
            out["ci"] = True
        elif option.startswith("sub "):
            parts = shlex.split(option[4:])
            if len(parts) != 3 or parts[1] != "->":
                raise MarkerError(f'{page}:{line}: write sub "A" -> "B", got {option!r}')
            subs.append((parts[0], parts[2]))
        elif option:
            raise MarkerError(f"{page}:{line}: unknown option {option!r} in {text!r}")
    out["subs"] = tuple(subs)
    return out


def blocks(path: str = README) -> list[Block]:
    """Every fenced block of ``path`` with its marker; raises MarkerError for an unmarked one."""
    page = os.path.relpath(os.path.abspath(path), ROOT)
    with open(path) as f:
        lines = f.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise MarkerError(f"{page}:{i + 1}: the fenced block is never closed")
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        if not marker:
            raise MarkerError(f"{page}:{i + 1}: fenced block without a '<!-- readme-test: ... -->' line above it")
        code = "\n".join(lines[i + 1:end]) + "\n"
        block = Block(i + 1, fence.group(1), code, page=page, **_parse_marker(marker.group(1), i, page))
        if block.ci and page != "README.md":
            raise MarkerError(f"{page}:{i + 1}: 'ci' blocks belong on README.md (the README install check)")
        for old, _ in block.subs:
            if old not in code:
                raise MarkerError(f"{page}:{i + 1}: sub {old!r} does not occur in the block")
        out.append(block)
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    """The blocks of every page in ``pages()`` order."""
    return [block for page in pages() for block in blocks(os.path.join(ROOT, page))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci-dir", help="write the 'ci' blocks to DIR/NN.sh")
    args = parser.parse_args()
    try:
        found = all_blocks()
    except MarkerError as err:
        sys.exit(f"readme_blocks: {err}")
    if args.ci_dir:
        os.makedirs(args.ci_dir, exist_ok=True)
        for n, block in enumerate(b for b in found if b.ci):
            with open(os.path.join(args.ci_dir, f"{n:02d}.sh"), "w") as f:
                f.write(f"# README.md:{block.line}\n{block.code}")
        return
    for block in found:
        print(block.name + (f"  [{block.kind}: {block.reason}]" if block.kind in ("skip", "text") else ""))


if __name__ == "__main__":
    main()
