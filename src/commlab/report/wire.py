"""Bytes on the wire for the claims tables: each method's measured volume over its accounted one.

Every volume claim of the reports (Ok-Topk's "< 6k per worker", TopkA's 2k(P-1), "RedSync sends
0.1%", the MB-sent axes) is the Communicator's accounting. ``commlab bench wire`` sets it beside
what the emulated links carried in the same steps (``reports/bench/wire.json``; docs/network.md,
"Bytes on the wire"); a volume claim quotes that ratio for the methods it compares, as the
speed claims quote the throughput benchmark.

    from commlab.report.bench import load_bench
    wire = load_bench("wire", out_dir)                  # None when the benchmark did not run
    wire_ratios(wire, ["oktopk", "topk_allgather"])     # one row per method (and model, link)
    wire_note(wire, ["oktopk", "topk_allgather"])       # the sentence for the claim's note
"""

from __future__ import annotations

import pandas as pd

COLUMNS = ["method", "model", "network", "accounted", "payload", "raw", "payload_over_accounted",
           "payload_over_expected", "within_tolerance", "note"]


def wire_ratios(wire: dict | None, methods: list[str] | None = None, model: str | None = None) -> pd.DataFrame:
    """The wire table's rows for ``methods`` (all when None), optionally of one ``model``: bytes per
    step and worker accounted, on the wire (payload and raw), their ratios, and what explains a
    gap. Methods the benchmark did not measure have a row with only their note."""
    rows = [r for r in (wire or {}).get("rows", [])
            if (methods is None or r["method"] in methods) and (model is None or r.get("model") in (None, model))]
    if methods is not None:
        missing = [m for m in methods if m not in {r["method"] for r in rows}]
        rows += [{"method": m, "note": "not measured: commlab bench wire has no row for it"} for m in missing]
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def wire_note(wire: dict | None, methods: list[str], model: str | None = None) -> str:
    """One sentence for a volume claim: each method's wire payload over its accounted bytes, and
    whether the accounting describes the wire (within the benchmark's tolerance) or what differs.

    'wire/accounted bytes per step (commlab bench wire): oktopk 1.04 (cnn, 100Mbit), topk_allgather
    1.01 (cnn, 100Mbit); the accounting is within 10% of the wire for all'"""
    if not wire:
        return "wire volume not measured (commlab bench wire did not run: it needs emulated links)"
    table = wire_ratios(wire, methods, model)
    tolerance = wire.get("tolerance", 0.1)
    parts, off = [], []
    for _, row in table.iterrows():
        if pd.isna(row["payload_over_accounted"]):
            parts.append(f"{row['method']}: {row['note']}")
            continue
        parts.append(f"{row['method']} {row['payload_over_accounted']:.2f} ({row['model']}, {row['network']})")
        if not row["within_tolerance"]:
            off.append(f"{row['method']} ({row['note']})")
    verdict = (f"the accounting is within {tolerance:.0%} of the wire for all measured" if not off
               else "beyond " + f"{tolerance:.0%}: " + "; ".join(off))
    return "wire/accounted bytes per step (commlab bench wire): " + ", ".join(parts) + "; " + verdict
