"""Functions queued on a coordinator's book, for tests of the book and of what settles it (no cluster)."""

from __future__ import annotations

from daskps.coordinator.book import Book


def queued(book: Book, n: int) -> list:
    """``n`` new functions queued on ``book`` (under its lock, as ``schedule`` queues them)."""
    with book.lock:
        return [book.add((b"f", b"args"), [], 0) for _ in range(n)]
