"""Bytes on the wire of an emulated run: what each worker's link carried beside what its
Communicator accounted, over a window of log points (docs/network.md, "Bytes on the wire").

Each worker of an emulated run appends its totals at every log point to ``<folder>/rank<r>.jsonl``
(:class:`commlab.core.stats.WireMeter`): the accounted ``bytes_sent``/``bytes_recv`` and its
interface's ``wire_*`` counters, read at the same moment. The log points are where all ranks meet
(the loop's control allreduce), so line ``i`` of every rank describes the same step. A window of
steps is then the difference of two lines, per rank and summed over the ranks. The payload
estimate subtracts one set of Ethernet/IPv4/TCP headers per counted frame
(:data:`~commlab.launch.netem.FRAME_HEADER_BYTES`); what remains is gloo's bytes, its own framing
included.

    logs = read_logs(folder, world_size)
    w = window(logs, first=1, last=4, steps=15)
    w["sum"]["wire_tx_payload"] / w["sum"]["bytes_sent"]     # wire payload over accounted
"""

from __future__ import annotations

import json
from pathlib import Path

from commlab.launch.netem import FRAME_HEADER_BYTES

ACCOUNTED = ("bytes_sent", "bytes_recv", "messages_sent")
WIRE = ("wire_tx_bytes", "wire_rx_bytes", "wire_tx_packets", "wire_rx_packets")


def read_logs(folder: str | Path, world_size: int) -> list[list[dict]]:
    """Every rank's log-point lines, in rank order."""
    logs = []
    for rank in range(world_size):
        path = Path(folder) / f"rank{rank}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"no wire log of rank {rank}: {path} (was the run on an emulated network?)")
        logs.append([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    return logs


def payload(frames: dict, direction: str = "tx") -> float:
    """Bytes of ``direction`` (tx or rx) minus one set of headers per counted frame."""
    return frames[f"wire_{direction}_bytes"] - FRAME_HEADER_BYTES * frames[f"wire_{direction}_packets"]


def delta(start: dict, end: dict, steps: int = 1) -> dict:
    """Accounted and wire figures between two samples, per step, with the payload estimates and
    (``by_op``) the accounted bytes and messages of each operation."""
    d = {k: (end[k] - start[k]) / steps for k in ACCOUNTED + WIRE if k in start and k in end}
    if "wire_tx_bytes" in d:
        d["wire_tx_payload"], d["wire_rx_payload"] = payload(d, "tx"), payload(d, "rx")
    if "by_op" in end:
        before = start.get("by_op") or {}
        d["by_op"] = {op: {k: (v - before.get(op, {}).get(k, 0)) / steps for k, v in figures.items()}
                      for op, figures in (end["by_op"] or {}).items()}
        d["by_op"] = {op: f for op, f in d["by_op"].items() if any(f.values())}
    return d


def summed(per_rank: list[dict]) -> dict:
    """The sum over ranks of every figure, and the payload sent over the bytes accounted as sent."""
    total = {k: sum(d[k] for d in per_rank) for k in per_rank[0] if k != "by_op"} if per_rank else {}
    ops = sorted({op for d in per_rank for op in d.get("by_op", {})})
    if ops:
        total["by_op"] = {op: {k: sum(d.get("by_op", {}).get(op, {}).get(k, 0) for d in per_rank)
                               for k in ("bytes_sent", "messages_sent")} for op in ops}
    if total.get("bytes_sent") and "wire_tx_payload" in total:
        total["payload_over_accounted"] = total["wire_tx_payload"] / total["bytes_sent"]
    return total


def window(logs: list[list[dict]], first: int, last: int, steps: int) -> dict:
    """Per-step figures between log points ``first`` and ``last`` (line indices): ``per_rank``
    and ``sum``. ``log_points`` counts the log points inside the window (each runs the loop's
    control allreduce, which the accounting leaves out)."""
    if steps <= 0 or not 0 <= first < last:
        raise ValueError(f"a wire window needs 0 <= first < last and steps > 0, got {first}, {last}, {steps}")
    for rank, lines in enumerate(logs):
        if len(lines) <= last:
            raise ValueError(f"rank {rank} logged {len(lines)} points; the window needs point {last}")
    per_rank = [delta(lines[first], lines[last], steps) for lines in logs]
    return {"steps": steps, "log_points": last - first, "per_rank": per_rank, "sum": summed(per_rank)}


def write_summary(folder: str | Path, world_size: int) -> Path | None:
    """``<folder>/summary.json``: what every rank accounted and carried between its first and last
    log point (per rank and summed), or None when the run logged fewer than two points."""
    logs = read_logs(folder, world_size)
    last = min(len(lines) for lines in logs) - 1
    if last < 1:
        return None
    summary = window(logs, 0, last, 1)
    summary.pop("steps")
    path = Path(folder) / "summary.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def counters_delta(before: list[dict], after: list[dict]) -> dict:
    """Whole-run figures from :meth:`~commlab.launch.netem.EmulatedNetwork.counters` read before
    and after (start-up, rendezvous, warm-up and evaluation included): per rank and summed."""
    per_rank = [delta({f"wire_{k}": v for k, v in a.items()}, {f"wire_{k}": v for k, v in b.items()})
                for a, b in zip(before, after, strict=True)]
    return {"per_rank": per_rank, "sum": summed(per_rank)}
