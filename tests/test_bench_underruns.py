"""The client-side underrun count the capacity benchmarks report (orchestrator.bench)."""

from orchestrator.bench import late_chunks


def test_late_chunks_follow_the_listeners_clock():
    # chunks of 0.1 s: the third arrives 0.25 s after the first, when 0.2 s had been played
    arrivals = [(10.0, 0.1), (10.05, 0.1), (10.25, 0.1), (10.30, 0.1)]
    assert late_chunks(arrivals, 0.0) == 1
    assert late_chunks(arrivals, 49.0) == 1  # the buffer covers 0.049 s of the 0.05 s gap
    assert late_chunks(arrivals, 51.0) == 0
    # a stall is not forgiven: every chunk behind the original schedule counts
    assert late_chunks([(0.0, 0.1), (0.5, 0.1), (0.55, 0.1)], 150.0) == 2
    assert late_chunks([], 150.0) == 0 and late_chunks([(1.0, 0.2)], 0.0) == 0
