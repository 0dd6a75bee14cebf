"""Where things are, for tests in any folder of the suite."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
