"""Stop sequences: cutting a finished text and filtering a stream."""

from langchain_cachegen.stop import StopStreamer, cut_at_stop


def test_stop_helpers():
    assert cut_at_stop("abc STOP def", ["STOP"]) == ("abc ", True)
    s = StopStreamer(["END"])
    out = "".join(s.feed(p) for p in ["hello E", "N", "D more"]) + s.finish()
    assert out == "hello "
    s = StopStreamer(["END"])
    assert "".join(s.feed(p) for p in ["a E", "x"]) + s.finish() == "a Ex"
