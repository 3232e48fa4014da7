"""``rollout.backend: vllm`` settings and start-up failures that need no vLLM installation."""
import stat

import pytest

from trajgrad.rollout.vllm_server import VLLMServer, vllm_flags
from trajgrad.train.config import build_config
from trajgrad.train.config_checks import check_config, check_effective


def _cfg(**rollout):
    return build_config({"rollout": rollout})


def test_vllm_keys_take_effect_only_with_backend_vllm():
    with pytest.raises(ValueError, match=r"rollout\.vllm\.startup_timeout_s.*rollout\.backend is 'vllm'"):
        check_effective(_cfg(vllm={"startup_timeout_s": 5.0}), ["rollout.vllm.startup_timeout_s"])
    check_effective(_cfg(backend="vllm", vllm={"startup_timeout_s": 5.0}, base_url="http://127.0.0.1:1"),
                    ["rollout.backend", "rollout.vllm.startup_timeout_s", "rollout.base_url"])
    with pytest.raises(ValueError, match=r"rollout\.server.*'openai'"):
        check_effective(_cfg(backend="vllm", server="vllm"), ["rollout.backend", "rollout.server"])


def test_tiny_model_is_refused_for_vllm():
    with pytest.raises(ValueError, match=r"model\.name.*character tokenizer"):
        build_config({"model": {"name": "tiny"}, "rollout": {"backend": "vllm"}})
    check_config(_cfg(backend="vllm"))  # SmolLM2 is a Hugging Face checkpoint


def test_flags_for_exact_ratios():
    f = vllm_flags(dtype="bfloat16", lora_rank=8)
    assert f[:7] == ["--dtype", "bfloat16", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                     "--return-tokens-as-token-ids"]
    assert f[7:] == ["--enable-lora", "--max-lora-rank", "8"]


def test_missing_interpreter_names_make_vllm(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"rollout\.vllm\.python.*make vllm"):
        VLLMServer(tmp_path, python=str(tmp_path / "nope"))


def test_server_that_exits_at_start_is_one_error_quoting_its_log(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named vllm'\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    srv = VLLMServer(tmp_path, python=str(fake), console=lambda *_: None)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 before it was healthy.*No module named vllm"):
        srv.start()
    assert not srv.alive()


def test_ray_workers_refuse_a_backend_they_would_not_sample_with(tmp_path):
    """The Ray workers sample in process ('hf') or from the learner's vLLM server ('vllm'); an
    'openai' run is refused at load time (SAO) and when the grouped baseline is built."""
    from trajgrad.train.asynchronous import GroupedRayTrainer

    rollout = {"backend": "openai", "base_url": "http://127.0.0.1:1"}
    with pytest.raises(ValueError, match=r"rollout\.backend: 'openai' is not what Ray workers sample with.*"
                                         r"\(asynchronous\.enabled\)"):
        build_config({"rollout": rollout, "recipe": {"name": "sao"}, "asynchronous": {"enabled": True}})
    cfg = build_config({"model": {"name": "tiny"}, "rollout": rollout, "recipe": {"name": "grpo"}})
    with pytest.raises(ValueError, match=r"^rollout\.backend: 'openai' is not what Ray workers sample with"):
        GroupedRayTrainer(cfg, tmp_path / "run", console=lambda *_: None)
    assert not (tmp_path / "run").exists()
