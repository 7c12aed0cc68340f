"""Fixtures shared by test modules."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a module (`pytestmark = usefixtures("one_thread")`):
    tiny models gain nothing from threads, and on a busy machine they lose a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
