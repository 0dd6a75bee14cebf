"""The ```python blocks of the README and the docs, as a reader copies them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

README = Path(__file__).resolve().parents[2] / "README.md"
NOTEBOOK_MARK = "In a notebook or IPython:"
STARTS_A_CLUSTER = re.compile(r"\b(LocalPSCluster|LocalCluster)\(")
GUARD = 'if __name__ == "__main__":'


class Block(NamedTuple):
    line: int  # of the opening fence, 1-based
    code: str
    notebook: bool  # the last line before the fence is NOTEBOOK_MARK


def python_blocks(text: str) -> list[Block]:
    """Every ```python block of ``text``, dedented by its fence's indentation (blocks in lists)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.fullmatch(r"(\s*)```python\s*", lines[i])
        if not fence:
            i += 1
            continue
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        start, indent = i, len(fence.group(1))
        i += 1
        while lines[i].strip() != "```":
            i += 1
        code = "\n".join(line[indent:] for line in lines[start + 1 : i]) + "\n"
        blocks.append(Block(start + 1, code, before.endswith(NOTEBOOK_MARK)))
    return blocks


# Every ```python block of the README runs here (the docs' blocks run in tests/docs/test_pages.py); shell
# commands are fenced ```bash. Each starts a cluster, so each must be a guarded script or notebook code.
CLUSTER_BLOCKS = python_blocks(README.read_text())
