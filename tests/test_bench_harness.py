"""benchmarks/harness.py's shared pieces without a device: the options, the
rows on disk and their resume, the run's time budget."""
import json

import pytest

from benchmarks import harness


def test_parser_shared_options_and_out_required_outside_a_child(capsys):
  ap = harness.parser("One line.\n\nMore.", out=None, resume=True,
                      budget_s=2.5, timeout_s=30)
  a = ap.parse_args(["--out", "/tmp/x", "--resume"])
  assert (a.out, a.resume, a.budget_s, a.timeout_s) == ("/tmp/x", True, 2.5, 30)
  assert ap.parse_args(["--case", "{}"]).case == "{}"  # A child: no --out.
  with pytest.raises(SystemExit):
    ap.parse_args([])
  assert "--out is required" in capsys.readouterr().err
  assert ap.description == "One line."


def test_rows_resume_keeps_what_keep_accepts(tmp_path):
  key = lambda r: r["case"]  # noqa: E731
  rows = harness.Rows(str(tmp_path), "r", key=key, fields=["case", "status"])
  rows.add(dict(case="a", status="ok", ms=1.0))
  rows.add(dict(case="b", status="timeout>5s"))
  rows.add(dict(case="c", status="ok"))
  again = harness.Rows(str(tmp_path), "r", key=key, resume=True,
                       keep=lambda s: not s.startswith("timeout"),
                       fields=["case", "status"])
  assert again.earlier(dict(case="a"))["ms"] == 1.0
  assert again.earlier(dict(case="b")) is None  # Runs again.
  again.add(dict(case="b", status="ok"))
  # The table: this run's rows, then the earlier ones it did not reach.
  with open(tmp_path / "r.csv") as fh:
    assert fh.read().split() == ["case,status", "a,ok", "b,ok", "c,ok"]
  with open(tmp_path / "r.jsonl") as fh:  # The log: what a resume reads.
    assert sorted(json.loads(l)["case"] for l in fh) == ["a", "b", "c"]
  fresh = harness.Rows(str(tmp_path), "r", key=key)  # No resume: empty.
  assert fresh.earlier(dict(case="a")) is None
  assert harness.read_jsonl(fresh.jsonl) == []


def test_budget_skips_and_deadlines():
  none = harness.Budget(None)
  assert none.skip(1e9) is None and none.deadline(90, 45, 30) == 90
  spent = harness.Budget(0)
  assert spent.skip().startswith("skipped: 0 s of the 0 s budget left")
  assert spent.deadline(90, 45, 30) == pytest.approx(45, abs=1)
  some = harness.Budget(100)
  assert some.skip(50) is None and some.skip(200).endswith("needs ~200 s")
  assert some.deadline(30) == 30 and some.deadline(500) == pytest.approx(100, abs=1)


def _parked(ready, stop):
  ready.set()
  stop.wait(30)


def test_stack_sampler_names_where_a_thread_waits():
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  stop = threading.Event()
  threads = []
  # Names no other thread of the process has: an earlier test's decode
  # pool threads ("decode-shard_N") may still be alive in this worker.
  for name in ("sampler-test-watched", "sampler-test-other"):
    ready = threading.Event()
    threads.append(threading.Thread(target=_parked, args=(ready, stop), name=name))
    threads[-1].start()
    ready.wait()
  # ready.set() precedes the wait by a few bytecodes; on a loaded CI host the
  # first samples can still land there, so the test waits for a few more
  # samples after the start and judges the most frequent place, not the only.
  with harness.StackSampler(("sampler-test-w",), interval_s=0.001) as s:
    time.sleep(0.2)
  stop.set()
  for t in threads:
    t.join()
  top = s.top()
  assert top and all(w.startswith("sampler-test-watched: ")
                     for w, _ in top), top
  where, share = top[0]
  assert where.startswith(
      "sampler-test-watched: test_bench_harness.py:_parked:"), top
  assert where.endswith("> threading.py:wait") and share > 0.8, top


def test_ready_at_times_an_array_from_a_thread():
  import time  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  x = jax.jit(lambda a: a @ a)(jnp.ones((64, 64)))
  ready = harness.ReadyAt(x, t0)
  s = ready.seconds()
  assert 0 < s <= time.perf_counter() - t0
  x.delete()
  with pytest.raises(RuntimeError, match="deleted"):
    harness.ReadyAt(x, t0).seconds()
