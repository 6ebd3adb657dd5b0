"""Suite-wide settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One intra-op thread: the suite shares two cores, and no result depends on the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
