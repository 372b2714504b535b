"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip cleanly without CUDA."""

import os
import tempfile

import pytest
import torch

# Every test run gets its own artifact cache unless the caller chose one.
os.environ.setdefault("CUTE_KERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="cute_kernels_test_cache_"))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
