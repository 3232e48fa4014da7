"""Test-session settings shared by every test module."""
import os

import pytest
import torch

# With pytest-xdist each worker is its own process: one intra-op thread per worker keeps
# the two CI cores from being oversubscribed (OpenMP spin-waits make that ~10x slower).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (tiny models are dominated by thread synchronisation; fixed
    thread counts also give the same numbers whatever the runner)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    """The character-level tokenizer of the tiny test models."""
    from trajgrad.model.tokenizer import build_char_tokenizer

    return build_char_tokenizer()
