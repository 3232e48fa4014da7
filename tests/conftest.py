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


# ----------------------------------------------------------------------------- vLLM
# One vLLM server for the session (tests/_vllm.py); the vLLM tests share the xdist group "vllm"
# (`make test` runs with --dist loadgroup), so one worker starts it.


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """``(url, model_dir, tokenizer)`` of a running vLLM server (LoRA enabled, rank 8) on the test model."""
    import _vllm

    why = _vllm.vllm_unavailable()
    if why:
        pytest.skip(why)
    from trajgrad.rollout.vllm_server import VLLMServer

    model_dir = tmp_path_factory.mktemp("vllm") / "model"
    _, tokenizer = _vllm.build_test_model(model_dir)
    if os.environ.get("TRAJGRAD_TEST_VLLM_URL"):  # a server already running on this test model (seed 0)
        yield os.environ["TRAJGRAD_TEST_VLLM_URL"], model_dir, tokenizer
        return
    srv = VLLMServer(model_dir, python=_vllm.vllm_python(), served_name="policy", lora_rank=8, max_model_len=1024,
                     extra_args=_vllm.SERVER_ARGS, env=_vllm.SERVER_ENV, startup_timeout_s=600,
                     console=lambda *_: None)
    srv.start()
    yield srv.url, model_dir, tokenizer
    srv.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``CI=true`` a skipped vLLM test (tests/test_vllm*.py) is a failure: CI builds .venv-vllm."""
    outcome = yield
    rep = outcome.get_result()
    module = getattr(getattr(item, "module", None), "__name__", "")
    if rep.skipped and os.environ.get("CI", "").lower() == "true" and module.startswith("test_vllm"):
        rep.outcome = "failed"
        rep.longrepr = f"CI=true: the vLLM test was skipped ({rep.longrepr}); `make vllm` must provide .venv-vllm"
