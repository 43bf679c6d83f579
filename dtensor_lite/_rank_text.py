"""Ranks as a person reads them in an error message: "rank 3", "ranks 0-2", "ranks 0, 2, 5-7"."""
from __future__ import annotations

__all__ = ["ranks_text", "grouped_by"]


def ranks_text(ranks) -> str:
    ranks = sorted(set(int(r) for r in ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return "ranks " + ", ".join(runs)


def grouped_by(values: dict) -> str:
    """``{rank: text}`` as "text on ranks 0-2 vs other on rank 3" (most ranks first)."""
    groups: dict = {}
    for rank, text in values.items():
        groups.setdefault(text, []).append(rank)
    order = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    return " vs ".join(f"{text} on {ranks_text(rs)}" for text, rs in order)
