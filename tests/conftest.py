"""Test-session settings shared by every test module."""
import os

import torch

# With pytest-xdist each worker is its own process: one intra-op thread per worker keeps
# the two CI cores from being oversubscribed (OpenMP spin-waits make that ~10x slower).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
