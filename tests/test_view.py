"""`trajgrad view`: the token log holds the update's own tensors, the page data, a self-contained
page, the loopback server, the CLI's errors, and the page driven in headless Chromium."""
import json
import math
import re
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from trajgrad.cli import app
from trajgrad.objective import explain
from trajgrad.rollout import Trajectory, TrajectoryLog, Turn, collate, read_trajectories
from trajgrad.train import tokenlog, updates
from trajgrad.train.config import build_config
from trajgrad.train.trainer import Trainer
from trajgrad.view import build_page, page_data, read_run, write_view
from trajgrad.view.pagedata import detail_lookup
from trajgrad.view.server import make_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else shutil.which("chromedriver")


def tiny_config(name="view", **sections):
    data = {
        "name": name,
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        "task": {"name": "calculator", "n_train": 64, "n_heldout": 4,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 2, "min_ops": 1, "max_ops": 1,
                             "max_operand": 9}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "recipe": {"name": "grpo", "overrides": {"kl_coef": 0.0, "kl_placement": "none"}},
        "train": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 2},
        "sft": {"steps": 1, "batch_size": 4},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": False},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return build_config(data)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run directory made by the trainer: the tiny model, two GRPO steps."""
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("view") / "run"
    cfg = tiny_config()
    Trainer(cfg, run, console=lambda *_: None).run()
    return run, cfg


# ---------------------------------------------------------------------- the token log is the loss's tensors
def _update_with_record(tmp_path, cfg, noise_old=0.4, noise_behaviour=0.0, seed=0):
    """One policy update on real trajectories with chosen advantages and old log-probs, recorded."""
    torch.manual_seed(seed)
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    trajs, _ = tr._collect()
    batch = collate(trajs, tr.pad_id)
    mask = batch.action_mask
    with torch.no_grad():
        lp0 = updates.logprobs(tr.learner, batch).logp.double()
    g = torch.Generator().manual_seed(seed + 1)
    adv = torch.randn(len(batch), generator=g, dtype=torch.float64)
    old = torch.where(mask, lp0 + noise_old * torch.randn(lp0.shape, generator=g, dtype=torch.float64), 0.0)
    behaviour = torch.where(mask, old + noise_behaviour * torch.randn(lp0.shape, generator=g, dtype=torch.float64), 0.0)
    with tokenlog.recording(tr, batch) as rec:
        updates.policy_update(tr.learner, batch, adv, old, None, behaviour=behaviour, behaviour_logp=behaviour)
    assert rec is not None
    lines = tokenlog.read_token_log(tmp_path / "run" / "tokens.jsonl")
    return tr, batch, lp0, adv, old, behaviour, lines


def test_token_log_holds_the_values_and_gradient_of_the_ppo_clip_loss(tmp_path):
    cfg = tiny_config()
    obj = cfg.objective()
    tr, batch, lp0, adv, old, _, lines = _update_with_record(tmp_path, cfg)
    assert len(lines) == len(batch)
    B = len(batch)
    eps_lo, eps_hi = obj.eps_low, obj.eps_high_
    n_clipped = 0
    for b, line in enumerate(lines):
        m = batch.action_mask[b]
        n = int(m.sum())
        assert line["episode_id"] == batch.episode_ids[b] and line["step"] == 1 and line["n"] == n
        assert line["learner_version"] == 0 and line["epochs"] == 1
        lp = torch.tensor(line["logp"], dtype=torch.float64)
        torch.testing.assert_close(lp, lp0[b][m], rtol=1e-5, atol=1e-5)  # the log-probs the loss differentiated
        torch.testing.assert_close(torch.tensor(line["old"], dtype=torch.float64), old[b][m], rtol=1e-5, atol=1e-6)
        assert line["adv"] == pytest.approx([float(adv[b])] * n, rel=1e-5)
        r = torch.tensor(line["ratio"], dtype=torch.float64)
        torch.testing.assert_close(r, torch.exp(lp0[b][m] - old[b][m]), rtol=1e-4, atol=1e-6)
        # PPO clip (§8), hand-written: no gradient once the ratio leaves the region on the advantage's side
        a = float(adv[b])
        clipped = ((a > 0) & (r > 1 + eps_hi)) | ((a < 0) & (r < 1 - eps_lo))
        assert line["zero_grad"] == [int(x) for x in clipped.tolist()]
        n_clipped += int(clipped.sum())
        # seq_mean_token_mean: L = (1/B) sum_i (1/n_i) sum_t -min(r A, clip(r) A); -dL/dlogp = r A / (B n_i)
        expected = torch.where(clipped, torch.zeros_like(r), r * a / (B * n))
        torch.testing.assert_close(torch.tensor(line["grad"], dtype=torch.float64), expected, rtol=1e-4, atol=1e-9)
        assert len(line["entropy"]) == n and all(x > 0 for x in line["entropy"])
    assert 0 < n_clipped < sum(line["n"] for line in lines)  # both branches exercised


def test_token_log_records_the_rollout_correction_masks(tmp_path):
    rc = {"kind": "mis", "level": "token", "bounds": [0.8, 1.25]}
    cfg = tiny_config(recipe={"name": "grpo", "overrides": {"kl_coef": 0.0, "kl_placement": "none",
                                                            "rollout_correction": rc}})
    tr, batch, lp0, adv, old, behaviour, lines = _update_with_record(tmp_path, cfg, noise_old=0.05, noise_behaviour=0.3)
    dropped = 0
    for b, line in enumerate(lines):
        m = batch.action_mask[b]
        rho = torch.exp(old[b][m] - behaviour[b][m])  # decoupled: pi_old / mu
        keep = (rho >= 0.8) & (rho <= 1.25)
        assert line["rc_keep"] == [int(x) for x in keep.tolist()]
        w = torch.tensor(line["is_weight"], dtype=torch.float64)
        torch.testing.assert_close(w, torch.where(keep, rho, torch.zeros_like(rho)), rtol=1e-4, atol=1e-7)
        grad = torch.tensor(line["grad"], dtype=torch.float64)
        assert torch.all(grad[~keep] == 0)  # dropped by the correction: no gradient ...
        assert all(z == 0 for z, k in zip(line["zero_grad"], keep.tolist()) if not k)  # ... and not called clipped
        dropped += int((~keep).sum())
    assert dropped > 0


def test_token_log_is_capped_appended_and_cut_on_resume(tmp_path):
    path = tmp_path / "tokens.jsonl"
    log = tokenlog.TokenLog(path, max_bytes=400)
    line = lambda s: (json.dumps({"step": s, "episode_id": "e", "segment": 0, "adv": [0.5] * 10}) + "\n").encode()
    assert log.write([line(1)], 1) == 1
    assert log.write([line(2)], 2) == 1
    assert log.write([line(3), line(3), line(3)], 3) == 0  # over the cap: a marker, then nothing
    assert log.capped and log.write([line(4)], 4) == 0
    recs = tokenlog.read_token_log(path)
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[-1]["capped"] is True
    with open(path, "ab") as fh:
        fh.write(b'{"step": 9, "torn')  # a killed write
    resumed = tokenlog.TokenLog(path, max_bytes=400, start_step=2)  # resuming step 2: its lines are replayed
    assert [r["step"] for r in tokenlog.read_token_log(path)] == [1] and not resumed.capped
    with pytest.raises(ValueError, match="max_bytes"):
        tokenlog.TokenLog(path, max_bytes=0)


def test_token_log_config_keys_are_validated():
    assert tiny_config().log.token_log is True
    assert tiny_config(log={"token_log_max_mb": 2}).log.token_log_max_mb == 2
    with pytest.raises(ValueError, match="log.token_log_max_mb"):
        tiny_config(log={"token_log_max_mb": 0})
    with pytest.raises(ValueError, match="log.token_log"):
        tiny_config(log={"token_log": "yes"})


def test_token_log_off_writes_nothing(tmp_path):
    cfg = tiny_config(log={"token_log": False}, train={"steps": 1})
    Trainer(cfg, tmp_path / "run", console=lambda *_: None).run()
    assert not (tmp_path / "run" / "tokens.jsonl").exists()
    data = page_data(read_run(tmp_path / "run"))
    assert all(r["status"] == "—" for r in data["rows"]) and all("adv" not in d["ch"] for d in data["detail"].values())


# ---------------------------------------------------------------------- page data
def test_page_data_of_a_trained_run(tiny_run):
    run_dir, cfg = tiny_run
    trajs = read_trajectories(run_dir / "trajectories.jsonl")
    data = page_data(read_run(run_dir))
    rows = data["rows"]
    assert len(rows) == len(trajs) == data["caps"]["trajectories_total"] > 0
    tokens = {(r["episode_id"], r["segment"]): r for r in tokenlog.read_token_log(run_dir / "tokens.jsonl")}
    for row, t in zip(rows, trajs):
        assert row["id"] == t.episode_id and row["act"] == t.num_action_tokens and row["len"] == len(t)
        assert row["turns"] == len(t.turns) and row["reward"] == pytest.approx(t.total_reward)
        rec = tokens.get((t.episode_id, t.segment))
        if rec is not None:
            assert row["status"] == "trained" and row["step"] == rec["step"] and row["step_src"] == "token log"
            assert row["lag"] == rec["learner_version"] - min(turn.policy_version for turn in t.turns) == 0
        d = data["detail"][str(row["i"])]
        assert d["n_action"] == t.num_action_tokens == sum(1 for x in d["role"] if x == 1)
        assert d["ids"] == t.token_ids() and len(d["ch"]["behaviour"]) == t.num_action_tokens
        if rec is not None:
            assert d["ch"]["adv"] == rec["adv"] and d["ch"]["zero_grad"] == rec["zero_grad"]
    assert {r["step"] for r in rows} == {1, 2}
    # the char tokenizer decodes every id; the objective is explain() of the config's objective
    assert data["has_tokenizer"] and all(str(i) in data["vocab"] for i in trajs[-1].token_ids())
    assert data["objective"] == explain(cfg.objective())
    assert [p[0] for p in data["curves"]["loss"]] == [1, 2]


def test_page_caps_are_stated(tiny_run):
    run_dir, _ = tiny_run
    n = len(read_trajectories(run_dir / "trajectories.jsonl"))
    longest = max(len(t) for t in read_trajectories(run_dir / "trajectories.jsonl"))
    data = page_data(read_run(run_dir, max_trajectories=3), max_episodes=3, max_tokens=longest)
    assert len(data["rows"]) == 3 and data["caps"]["trajectories_total"] == n
    assert 1 <= len(data["detail"]) < 3 and data["caps"]["detail"] == len(data["detail"])
    with pytest.raises(ValueError, match="max_tokens"):
        page_data(read_run(run_dir), max_tokens=-1)


# ---------------------------------------------------------------------- the page is self-contained
def _write_records(run_dir: Path, action_text: str):
    run_dir.mkdir(parents=True)
    with TrajectoryLog(run_dir / "trajectories.jsonl") as log:
        for k in range(3):
            log.append(Trajectory(task_id=f"task-{k}", episode_id=f"ep-{k}", prompt_ids=[1, 40, 41],
                                  turns=[Turn(action_ids=[50, 51, 2], observation_ids=[1, 60], behaviour_logp=[-1.0] * 3,
                                              info={"tool": "calculator"}, action_text=action_text, reward=float(k)),
                                         Turn(action_ids=[52, 2], behaviour_logp=[-0.5, -0.1], reward=0.0)],
                                  success=k == 2, terminated=True))
    (run_dir / "config.json").write_text(json.dumps(tiny_config().model_dump()))


def test_html_is_self_contained_and_escapes_the_data(tmp_path):
    evil = "</script><script src=\"https://cdn.example/x.js\"></script><img src=http://e/x>"
    _write_records(tmp_path / "run", evil)
    page, _ = build_page(tmp_path / "run")
    m = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
    markup = page[:m.start(1)] + page[m.end(1):]
    # the markup, script and style load nothing: no URL with a scheme or a network path anywhere
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", markup, re.I)
    assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}/|@import|url\(|fetch\(\s*['\"]http", markup, re.I)
    # the data cannot end its element or add one: every <, > and & inside it is an escape
    assert page.count("</script>") == 2 and page.count("<script") == 2 and not re.search(r"[<>&]", m.group(1))
    data = json.loads(m.group(1))
    assert data["rows"][0]["search"].endswith(evil.lower()[:100]) or evil.lower()[:40] in data["rows"][0]["search"]
    assert data["detail"]["0"]["turns"][0]["tool"] == "calculator"


def test_detail_lookup_and_loopback_server(tmp_path):
    _write_records(tmp_path / "run", "<calc>2+2</calc>")
    page, run = build_page(tmp_path / "run", max_tokens=0, serve=True)
    assert json.loads(re.search(r'type="application/json">(.*?)</script>', page, re.S).group(1))["detail"] == {}
    lookup = detail_lookup(run)
    got = lookup(1)
    assert got["detail"]["n_action"] == 5 and got["vocab"]
    httpd = make_server(page, lookup, port=0)
    assert httpd.server_address[0] == "127.0.0.1"
    port = httpd.server_port
    th = threading.Thread(target=lambda: [httpd.handle_request() for _ in range(4)], daemon=True)
    th.start()
    try:
        base = f"http://127.0.0.1:{port}"
        assert urllib.request.urlopen(base + "/", timeout=10).read().decode() == page
        ep = json.loads(urllib.request.urlopen(base + "/episode/2.json", timeout=10).read())
        assert ep["detail"]["ids"] == lookup(2)["detail"]["ids"]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(base + "/episode/99.json", timeout=10)
        req = urllib.request.Request(base + "/", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(req, timeout=10)
    finally:
        th.join(timeout=10)
        httpd.server_close()
    with pytest.raises(ValueError, match="port"):
        make_server(page, lookup, port=70000)


# ---------------------------------------------------------------------- CLI
def test_cli_view_writes_the_page_and_names_errors(tmp_path, tiny_run):
    runner = CliRunner()
    run_dir, _ = tiny_run
    out = tmp_path / "page.html"
    res = runner.invoke(app, ["view", str(run_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text().startswith("<!DOCTYPE html>")
    res = runner.invoke(app, ["view", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "run_dir" in res.output and "does not exist" in res.output
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["view", str(tmp_path / "empty")])
    assert res.exit_code == 2 and "no trajectories.jsonl" in res.output
    (tmp_path / "empty" / "trajectories.jsonl").write_text("")
    res = runner.invoke(app, ["view", str(tmp_path / "empty")])
    assert res.exit_code == 2 and "no trajectories yet" in res.output


# ---------------------------------------------------------------------- a real headless browser
@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium / chromedriver not installed (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(a)
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)  # the system driver: nothing downloaded
    yield drv
    drv.quit()


def test_page_in_headless_chromium(browser, tiny_run, tmp_path):
    from selenium.webdriver.common.by import By

    run_dir, _ = tiny_run
    path = write_view(run_dir, tmp_path / "view.html")
    data = page_data(read_run(run_dir))
    browser.get(path.resolve().as_uri())
    rows = lambda: browser.find_elements(By.CSS_SELECTOR, "#episodes tbody tr.ep-row")
    assert len(rows()) == len(data["rows"])
    # filter: text search, then a step range
    task = data["rows"][0]["task"]
    browser.find_element(By.ID, "search").send_keys(task)
    expected = sum(1 for r in data["rows"] if task.lower() in r["search"])
    assert len(rows()) == expected < len(data["rows"])
    browser.find_element(By.ID, "search").clear()
    browser.execute_script("const e = document.getElementById('search'); e.dispatchEvent(new Event('input'));")
    browser.find_element(By.ID, "step-min").send_keys("2")
    assert len(rows()) == sum(1 for r in data["rows"] if r["step"] >= 2) > 0
    # sort by reward, then open an episode: one .action element per trained token
    browser.find_element(By.CSS_SELECTOR, "#episodes th[data-key='reward']").click()
    row = rows()[0]
    i = int(row.get_attribute("data-i"))
    row.click()
    n_action = data["rows"][i]["act"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tokens .tok.action")) == n_action > 0
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tokens .turn-head")) == data["rows"][i]["turns"]
    # colour by the advantage and the clip flag; hover shows the per-token values
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    for ch in ("adv", "zero_grad", "ratio", "entropy", "mismatch", "role"):
        Select(browser.find_element(By.ID, "channel")).select_by_value(ch)
        assert len(browser.find_elements(By.CSS_SELECTOR, "#tokens .tok.action")) == n_action
    Select(browser.find_element(By.ID, "channel")).select_by_value("adv")
    tok = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok.action")[0]
    ActionChains(browser).move_to_element(tok).perform()
    tip = browser.find_element(By.ID, "tip").text
    assert "adv" in tip and "ratio" in tip and "grad" in tip
    assert len(browser.find_elements(By.CSS_SELECTOR, "#curves svg polyline")) > 0
    assert "ρ" in browser.find_element(By.ID, "objective").text or "ratio" in browser.find_element(By.ID, "objective").text
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []


def test_served_page_loads_detail_on_demand_in_chromium(browser, tiny_run):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    run_dir, _ = tiny_run
    page, run = build_page(run_dir, max_tokens=0, serve=True)  # nothing embedded: every row is fetched
    httpd = make_server(page, detail_lookup(run), port=0)
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    try:
        browser.get(f"http://127.0.0.1:{httpd.server_port}/")
        assert "--serve" not in browser.find_element(By.ID, "caps").text  # says the others load from the server
        row = browser.find_elements(By.CSS_SELECTOR, "#episodes tbody tr.ep-row")[1]
        i = int(row.get_attribute("data-i"))
        row.click()
        n = run.trajectories[i][2].num_action_tokens
        WebDriverWait(browser, 20).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tokens .tok.action")) == n)
        assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []
    finally:
        httpd.shutdown()
        httpd.server_close()
