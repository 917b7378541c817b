"""The wire table in the claims (commlab.report.wire): ratios and the claim's sentence, read from a
hand-made ``commlab bench wire`` payload."""

import math

from commlab.report.wire import wire_note, wire_ratios


def _row(method, model, accounted, payload, expected_ratio, note):
    return {"method": method, "model": model, "network": "100Mbit", "accounted": accounted, "payload": payload,
            "raw": payload * 1.1, "payload_over_accounted": round(payload / accounted, 2),
            "payload_over_expected": expected_ratio, "within_tolerance": abs(payload / accounted - 1) <= 0.1,
            "note": note}


WIRE = {"benchmark": "wire", "tolerance": 0.1, "rows": [
    _row("oktopk", "cnn", 6000.0, 6300.0, 1.0, "within 10%: gloo framing 4.0 msgs x 144 B = 9.6%"),
    _row("topk_allgather", "cnn", 2000.0, 2600.0, 1.01, "gap of +30.0%: gloo framing 4.0 msgs x 144 B = 28.8%"),
    _row("redsync", "resnet20", 9000.0, 9090.0, 1.0, "within 10%"),
    _row("redsync", "wide_mlp", 30000.0, 30300.0, 1.0, "within 10%"),
    {"method": "kstep", "note": "not measured: no emulated run of this method in the inputs"},
]}


def test_ratios_per_method_model_and_link():
    table = wire_ratios(WIRE, ["oktopk", "redsync"])
    assert list(table["method"]) == ["oktopk", "redsync", "redsync"]
    assert table.set_index("model").loc["wide_mlp", "payload_over_accounted"] == 1.01
    only = wire_ratios(WIRE, ["redsync"], model="resnet20")
    assert len(only) == 1 and only.iloc[0]["accounted"] == 9000.0
    assert len(wire_ratios(WIRE)) == 5
    # a method the benchmark has no row for is listed, with no numbers
    gone = wire_ratios(WIRE, ["gtopk"]).iloc[0]
    assert math.isnan(gone["payload_over_accounted"]) and "not measured" in gone["note"]


def test_note_quotes_the_ratio_and_names_what_is_off():
    good = wire_note(WIRE, ["oktopk", "redsync"], model="cnn")
    assert "oktopk 1.05 (cnn, 100Mbit)" in good and "within 10% of the wire for all measured" in good
    assert "redsync: not measured" in good  # no cnn row for redsync
    off = wire_note(WIRE, ["oktopk", "topk_allgather"])
    assert "topk_allgather 1.30" in off and "beyond 10%: topk_allgather (gap of +30.0%" in off
    assert "kstep: not measured" in wire_note(WIRE, ["kstep"])
    assert wire_note(None, ["oktopk"]).startswith("wire volume not measured")
