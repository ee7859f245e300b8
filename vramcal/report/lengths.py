"""Lengths that vary, for people: a profile's bucket table and token budget (:mod:`vramcal.sizing.batching`), as
``vramcal limits --buckets/--token-budget`` prints them and the report shows them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vramcal.calibration.lengths import Bucket, TokenBudget
from vramcal.profile import Profile
from vramcal.report.table import markdown_table
from vramcal.sizing import SizingError, batching
from vramcal.units import format_bytes


def _rows(table: Sequence[Bucket]) -> list[list[str]]:
    return [[f"{b.shortest_seq_len}-{b.longest_seq_len}", str(b.padded_seq_len), f"{b.safe_batch_size:,}",
             f"{b.conservative_batch_size:,}", b.basis] for b in table]


def budget_text(budget: TokenBudget) -> str:
    """The safe and conservative budget and how a batch is formed under it, in one sentence."""
    return (f"token budget over seq_len {budget.shortest_seq_len}-{budget.longest_seq_len}: {budget.tokens:,} tokens "
            f"per batch (conservative {budget.conservative_tokens:,}); a batch whose longest document has L tokens "
            f"holds floor(tokens / L) documents (L counted as at least {budget.shortest_seq_len}), padded to a "
            f"multiple of chunk_size {budget.chunk_size}")


def worst_text(case: batching.Worst, verdict: dict[str, Any], usable_bytes: int) -> str:
    """``worst case, the token budget: batch_size 189 of seq_len 32 (padded): verified by ... (peak ...)``."""
    state = {True: "verified", False: "NOT verified", None: "not verified"}[verdict["verified"]]
    peak = (f" (peak {format_bytes(verdict['peak_bytes'])} of usable {format_bytes(usable_bytes)})"
            if verdict["peak_bytes"] is not None else "")
    return (f"worst case, {case.what}: batch_size {case.batch_size} at seq_len {case.seq_len}: {state} by "
            f"{verdict['by']}{peak}")


def lengths_lines(profile: Profile, table: Sequence[Bucket] | None, budget: TokenBudget | None,
                  results: Sequence[tuple[batching.Worst, dict[str, Any]]]) -> list[str]:
    """``vramcal limits --buckets/--token-budget``'s text: the table, the budget and each worst case's verdict."""
    usable, lines = profile.settings.usable_bytes(profile.device.total_bytes), []
    if table:
        chunk = profile.surface.chunk_size if profile.surface else 1
        widths = [13, 9, 8, 13]
        lines.append(f"seq_len buckets (each batch sized at its bucket's longest length, padded to a multiple of "
                     f"chunk_size {chunk}):")
        header = ["lengths", "sized at", "safe", "conservative", "basis"]
        for row in [header, *_rows(table)]:
            lines.append("  " + "".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                                        enumerate(zip(row, widths))) + "  " + row[-1])
    if budget is not None:
        lines.append(budget_text(budget))
    lines += [worst_text(case, verdict, usable) for case, verdict in results]
    return lines


def varying_section(profile: Profile, level: str) -> list[str]:
    """The report's section over several lengths: buckets and token budget, each worst case's verifying trial."""
    if profile.surface is None:
        return []
    table, worst = batching.buckets(profile)
    usable = profile.settings.usable_bytes(profile.device.total_bytes)
    lines = [f"{level} Lengths that vary", "",
             ("Batches of documents of varying length (`vramcal limits --buckets`, `--token-budget`): each bucket's "
              "batch at its longest length, padded to a multiple of chunk_size (Mamba-2's chunked scan computes on "
              "whole chunks)."), "",
             markdown_table(["lengths", "sized at", "safe", "conservative", "basis"], _rows(table), right=[1, 2, 3]),
             ""]
    cases = [worst]
    try:
        budget, budget_worst = batching.budget(profile)
        lines += [budget_text(budget)[0].upper() + budget_text(budget)[1:] + ".", ""]
        cases += budget_worst
    except SizingError as error:
        lines += [f"No token budget: {error}.", ""]
    for case in cases:
        verdict = ({"verified": case.check.passed, "peak_bytes": case.check.peak_bytes, "by": "the calibration's trial"}
                   if case.check else {"verified": None, "peak_bytes": None, "by": "no trial"})
        lines.append(f"- {worst_text(case, verdict, usable)[0].upper()}{worst_text(case, verdict, usable)[1:]}")
    return lines + [""]
