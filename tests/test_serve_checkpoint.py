"""`trajgrad serve --model PATH` serves a user's save_pretrained checkpoint with the tokenizer training
uses (`AutoTokenizer` would rebuild this tokenizer as the model type's own class and drop whitespace)."""
import pytest

from _tiny_models import save_family_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_family_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt") / "my-qwen")


def test_serve_main_serves_a_checkpoint_directory_with_the_training_tokenizer(checkpoint, monkeypatch):
    import torch
    import uvicorn
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from trajgrad.model.pretrained import load_pretrained
    from trajgrad.serve import main

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    main(port=0, model=checkpoint)
    prompt = "hello  world\n  an indented line"
    _, train_tok = load_pretrained(checkpoint, dtype=torch.float32)
    n_train = len(train_tok.encode(prompt, add_special_tokens=False))
    assert n_train == len(prompt)  # one token per character, whitespace kept
    assert len(AutoTokenizer.from_pretrained(checkpoint).encode(prompt, add_special_tokens=False)) < n_train
    with TestClient(served["app"]) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "trajgrad-my-qwen"
        r = c.post("/v1/completions", json={"model": "trajgrad-my-qwen", "prompt": prompt, "max_tokens": 2,
                                            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == n_train


def test_serve_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from trajgrad.cli import app

    res = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "nope")])
    assert res.exit_code == 2 and res.output.startswith("error: --model: "), res.output
    assert len(res.output.strip().splitlines()) == 1
