"""Words in printed reports: one place for the small grammar every table and summary needs."""
from __future__ import annotations

__all__ = ["counted"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``counted(1, "bucket")`` -> ``"1 bucket"``; ``counted(3, "bucket")`` -> ``"3 buckets"``
    (``plural`` where adding an s is wrong: ``counted(2, "batch", "batches")``)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
