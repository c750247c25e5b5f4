import pytest

from r3lab.viz import transport_figure

RECORDS = [
    {"workload": w, "popularity": p, "method": m, "bytes_per_id": b}
    for w in ("64e top-8", "512e top-22")
    for p in ("uniform", "skewed")
    for m, b in (("compact + base64 + orjson", 1.333), ("r3lab topk-set", 0.516))
]


def test_transport_figure_has_one_bar_trace_per_method():
    fig = transport_figure(RECORDS)
    assert [t.name for t in fig.data] == ["compact + base64 + orjson", "r3lab topk-set"]
    assert list(fig.data[1].y) == [0.516, 0.516] and list(fig.data[0].x) == ["64e top-8", "512e top-22"]
    assert "uniform" in fig.layout.title.text


def test_transport_figure_refuses_missing_popularity():
    with pytest.raises(ValueError, match="popularity='bursty'"):
        transport_figure(RECORDS, popularity="bursty")
