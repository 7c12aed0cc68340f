"""Where a local deployment's services run (orchestrator.launcher.default_cpus)."""

import os

from orchestrator.launcher import VOCODER_NICE, default_cpus, vocoder_nice, vocoder_workers


def test_text_and_orchestrator_keep_the_lower_half_the_vocoder_spreads_over_all():
    assert default_cpus({0, 1}) == {"text": {0}, "orchestrator": {0}, "vocoder": {0, 1}}
    assert default_cpus({2, 5, 7}) == {"text": {2}, "orchestrator": {2}, "vocoder": {2, 5, 7}}
    big = default_cpus(set(range(16)))
    assert big["text"] == set(range(8)) and big["vocoder"] == set(range(16))
    assert vocoder_workers({0, 1}) == ["--workers", "2"]  # one forward in flight per core
    assert vocoder_workers(None) == vocoder_workers(set()) == []
    # the vocoder yields the cores it shares with the speech LM, and only those
    assert vocoder_nice(default_cpus({0, 1})) == VOCODER_NICE > 0
    assert vocoder_nice({"text": {0}, "orchestrator": {0}, "vocoder": {1}}) == 0
    assert vocoder_nice({}) == 0
    assert default_cpus({3}) == {}  # one core: nothing to split, nothing pinned
    assert default_cpus() == default_cpus(os.sched_getaffinity(0))
