"""Where a local deployment's services run (orchestrator.launcher.default_cpus)."""

import os

from orchestrator.launcher import default_cpus


def test_services_split_the_cores_text_and_orchestrator_below_vocoder_above():
    assert default_cpus({0, 1}) == {"text": {0}, "orchestrator": {0}, "vocoder": {1}}
    assert default_cpus({2, 5, 7}) == {"text": {2}, "orchestrator": {2}, "vocoder": {5, 7}}
    big = default_cpus(set(range(16)))
    assert big["text"] == set(range(8)) and big["vocoder"] == set(range(8, 16))
    assert default_cpus({3}) == {}  # one core: nothing to split, nothing pinned
    assert default_cpus() == default_cpus(os.sched_getaffinity(0))
