"""Bytes on the wire for the claims tables: each method's measured volume over its accounted one.

Every volume claim of the reports (Ok-Topk's "< 6k per worker", TopkA's 2k(P-1), "RedSync sends
0.1%", the MB-sent axes) is the Communicator's accounting. ``commlab bench wire`` sets it beside
what the emulated links carried in the same steps (``<out_dir>/bench/wire.json``; docs/network.md,
"Bytes on the wire"); a volume claim quotes that ratio for the methods it compares, as the
speed claims quote the throughput benchmark.

    from commlab.report.bench import load_bench
    wire = load_bench("wire", out_dir)                  # None when the benchmark did not run
    wire_ratios(wire, ["oktopk", "topk_allgather"])     # one row per method (and model, link)
    wire_note(wire, ["oktopk", "topk_allgather"])       # the sentence for the claim's note
"""

from __future__ import annotations

import pandas as pd

COLUMNS = ["method", "model", "network", "workers", "accounted", "payload", "raw", "payload_over_accounted",
           "payload_over_expected", "within_tolerance", "messages", "framing", "outside_by_name", "in_flight",
           "in_flight_cause", "note"]


def wire_ratios(wire: dict | None, methods: list[str] | None = None, model: str | None = None) -> pd.DataFrame:
    """The wire table's rows for ``methods`` (all when None), optionally of one ``model``: bytes per
    step and worker accounted, on the wire (payload and raw), their ratios, and what explains a
    gap. Methods the benchmark did not measure have a row with only their note."""
    rows = [r for r in (wire or {}).get("rows", [])
            if (methods is None or r["method"] in methods) and (model is None or r.get("model") in (None, model))]
    if methods is not None:
        missing = [m for m in methods if m not in {r["method"] for r in rows}]
        rows += [{"method": m, "note": "not measured: commlab bench wire has no row for it"} for m in missing]
        rows.sort(key=lambda r: methods.index(r["method"]))  # in the order asked for (stable within a method)
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def _gap_causes(row: pd.Series) -> str:
    """'gloo framing of 39 messages per step 11%, the metrics allreduce 0.3%': what the wire table
    names for a method's gap (its note where the row has no figures)."""
    accounted, messages = row.get("accounted"), row.get("messages")
    if pd.isna(messages) or not accounted:  # the table's own words, without its "gap of +x%: "
        note = str(row["note"])
        return note.split(": ", 1)[-1] if note.startswith(("gap of ", "within ")) else note
    parts = [f"gloo framing of {messages:.0f} messages per step {row['framing'] / accounted:.1%}"]
    outside = row.get("outside_by_name")
    named = outside if isinstance(outside, dict) else {}
    parts += [f"{name} {value / accounted:.1%}" for name, value in named.items() if value / accounted >= 0.0005]
    if row.get("in_flight"):
        cause = row.get("in_flight_cause") or "asynchronous collectives in flight"
        parts.append(f"{cause} up to {row['in_flight'] / accounted:.1%}")
    if "UNEXPLAINED" in str(row["note"]):
        parts.append(f"{row['payload_over_expected'] - 1:+.1%} beyond these (UNEXPLAINED)")
    return ", ".join(parts)


def wire_note(wire: dict | None, methods: list[str], model: str | None = None) -> str:
    """One sentence for a volume claim: each method's wire payload over its accounted bytes, and
    whether the accounting describes the wire (within the benchmark's tolerance) or what the
    difference is made of.

    'wire payload / accounted bytes per step (commlab bench wire; cnn, 4 workers, 100Mbit): oktopk
    1.11, topk_allgather 1.02; within 10% for all but oktopk 1.11: gloo framing of 34 messages per
    step 10.2%, the loop's control allreduce 0.5%, the metrics allreduce 0.2%'"""
    if not wire:
        return "wire volume not measured (commlab bench wire has not run: it needs emulated links, root and iproute2)"
    table = wire_ratios(wire, methods, model)
    tolerance = wire.get("tolerance", 0.1)
    measured = table[table.payload_over_accounted.notna()]
    settings = {_setting(row) for _, row in measured.iterrows()}
    shared = settings.pop() if len(settings) == 1 else None
    parts, off = [], []
    for _, row in table.iterrows():
        if pd.isna(row["payload_over_accounted"]):
            parts.append(f"{row['method']}: {row['note']}")
            continue
        ratio = f"{row['method']} {row['payload_over_accounted']:.2f}"
        parts.append(ratio if shared else f"{ratio} ({_setting(row)})")
        if not row["within_tolerance"]:
            off.append(f"{ratio}: {_gap_causes(row)}")
    head = "wire payload / accounted bytes per step (commlab bench wire" + (f"; {shared}" if shared else "") + "): "
    if measured.empty:
        return head + ", ".join(parts)
    verdict = (f"the accounting is within {tolerance:.0%} of the wire for all measured" if not off
               else f"within {tolerance:.0%} for all but " + "; ".join(off))
    return head + ", ".join(parts) + "; " + verdict


def _setting(row: pd.Series) -> str:
    workers = row.get("workers")
    return ", ".join([str(row["model"])] + ([f"{workers:.0f} workers"] if pd.notna(workers) else [])
                     + [str(row["network"])])
