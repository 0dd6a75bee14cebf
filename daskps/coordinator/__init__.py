"""The coordinator: scheduled functions and per-worker datasets."""
