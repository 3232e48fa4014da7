"""bench/spy_shares.py: shares of py-spy's collapsed stacks under a root frame."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("spy_shares", Path(__file__).parent.parent / "bench" / "spy_shares.py")
spy_shares = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spy_shares)

RAW = """\
main (x.py:1);train_step (t.py:2);sample_actions (g.py:3);decode_step (d.py:4) 6
main (x.py:1);train_step (t.py:2);sample_actions (g.py:3) 2
main (x.py:1);train_step (t.py:2);learner_logprobs (l.py:5) 2
main (x.py:1);startup (s.py:9) 90
190

"""


def test_shares_count_only_samples_under_the_root_and_nest():
    parts = [("sampler", "sample_actions ("), ("decode", "decode_step ("), ("forward", "learner_logprobs (")]
    total, got, skipped = spy_shares.shares(RAW.splitlines(), parts)
    assert total == 10  # the 90 start-up samples are outside train_step
    assert got == {"sampler": 0.8, "decode": 0.6, "forward": 0.2}
    assert skipped == 1  # the bare "190" (a frame name broken by a newline)


def test_no_samples_under_the_root_gives_zero_shares():
    total, got, _ = spy_shares.shares(["main (x.py:1) 5"], [("a", "b")])
    assert total == 0 and got == {"a": 0.0}
