"""The workdir records its run: config.json (the resolved config),
command.txt (each run's command line) and train.log (what process 0
printed, appended by each rerun); a rerun whose config changes the train
state or the data stream stops with one line naming the keys and the two
ways forward, while keys that may change on resume pass.
"""
import json
import os
import subprocess
import sys

import pytest

from train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "configs", "lit_demo.py") + ":tiny"


def _tiny():
  from configs import lit_demo  # pylint: disable=g-import-not-at-top
  return lit_demo.get_config("tiny")


def _recorded(config):
  return workdir_lib.config_as_json(config)


# ------------------------------------------------------------ quick checks


def test_changes_are_sorted_into_blocking_noted_and_free():
  old = _recorded(_tiny())
  new = _tiny()
  new.loss.name = "sigmoid"          # The loss head gains a bias: structure.
  new.seed = 3                       # Another data order.
  new.optim.lr = 5e-4                # Numbers from here on: a note.
  new.total_steps = 100              # Free.
  new.eval.every_steps = 7           # Free.
  new.checkpoint.every_minutes = 5.0  # Free.
  new.data.zeroshot_templates = ("a {}",)  # Free (held-out set).
  blocking, noted = workdir_lib.config_changes(old, _recorded(new))
  assert blocking == ["loss.name ('softmax' -> 'sigmoid')", "seed (0 -> 3)"]
  assert noted == ["optim.lr (0.002 -> 0.0005)"]
  # A key the old record lacks (a key added to the trainer since): noted.
  del old["model"]["image"]["locked"]
  assert workdir_lib.config_changes(old, _recorded(_tiny())) == (
      [], ["model.image.locked (None -> True)"])


def test_check_resume_is_one_line_naming_the_keys_and_ways_forward(tmp_path):
  config = _tiny()
  workdir_lib.record_run(str(tmp_path), config, "python -m train.main ...")
  notes = []
  workdir_lib.check_resume(str(tmp_path), config, log=notes.append)
  assert notes == []
  changed = _tiny()
  changed.loss.name = "sigmoid"
  changed.batch_size = 32
  with pytest.raises(ValueError) as e:
    workdir_lib.check_resume(str(tmp_path), changed, log=notes.append)
  msg = str(e.value)
  assert "\n" not in msg and str(tmp_path) in msg
  assert ("batch_size (16 -> 32), loss.name ('softmax' -> 'sigmoid'); use "
          "a new --workdir, or resume anyway with "
          "--config.resume_despite_changes=True") in msg
  changed.resume_despite_changes = True
  changed.optim.lr = 1e-4
  workdir_lib.check_resume(str(tmp_path), changed, log=notes.append)
  assert len(notes) == 1 and "batch_size (16 -> 32)" in notes[0] and (
      "optim.lr (0.002 -> 0.0001)" in notes[0])
  harmless = _tiny()
  harmless.total_steps = 20
  harmless.log_every_steps = 5
  workdir_lib.check_resume(str(tmp_path), harmless, log=notes.append)
  assert len(notes) == 1
  with open(tmp_path / "command.txt") as f:
    lines = f.read().splitlines()
  assert lines[0].startswith("# ") and lines[1] == "python -m train.main ..."


def test_run_log_keeps_the_last_state_of_redrawn_lines(tmp_path, capsys):
  log = workdir_lib.RunLog.capture()
  try:
    print("before the workdir exists")
    sys.stderr.write("\r 10%|#   | 1/8\r 50%|##  | 4/8\r100%|####| 8/8\n")
    log.attach(str(tmp_path))
    print("after", end="")
    print(" attach")
    log.log_only("Traceback (most recent call last): ...")
    print("unfinished", end="")
  finally:
    log.close()
  text = (tmp_path / "train.log").read_text().splitlines()
  assert text[0].startswith("# run started ")
  assert text[1:] == ["before the workdir exists", "100%|####| 8/8",
                      "after attach", "Traceback (most recent call last): ...",
                      "unfinished"]
  # The console saw everything, unchanged.
  out = capsys.readouterr()
  assert "before the workdir exists" in out.out and "4/8" in out.err
  assert "Traceback" not in out.out + out.err
  # A process other than 0 keeps nothing.
  other = workdir_lib.RunLog.capture()
  try:
    print("not process 0")
    other.attach(str(tmp_path), keep=False)
    print("still not")
  finally:
    other.close()
  assert "not process 0" not in (tmp_path / "train.log").read_text()


def test_command_line_names_the_trainer_module():
  main = os.path.join(ROOT, "train", "main.py")
  line = workdir_lib.command_line([main, "--config", "c.py:tiny",
                                   "--config.data.name=a b"])
  assert line == (f"{sys.executable} -m train.main --config c.py:tiny "
                  "'--config.data.name=a b'")


# ------------------------------------------------------- the command line


def _run(workdir, data_dir, *extra):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, "-m", "train.main", "--config", CONFIG, "--workdir",
       str(workdir), f"--config.data.data_dir={data_dir}", *extra],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_workdir_records_each_run_and_checks_a_rerun(tmp_path):
  work, data = tmp_path / "w", tmp_path / "tfds"
  r = _run(work, data, "--config.total_steps=4")
  assert r.returncode == 0, r.stderr[-3000:]
  with open(work / "config.json") as f:
    recorded = json.load(f)
  assert recorded["total_steps"] == 4 and recorded["loss"]["name"] == "softmax"
  assert recorded["data"]["data_dir"] == str(data)
  commands = (work / "command.txt").read_text().splitlines()
  assert commands[1] == (f"{sys.executable} -m train.main --config {CONFIG} "
                         f"--workdir {work} --config.data.data_dir={data} "
                         "--config.total_steps=4")
  log = (work / "train.log").read_text()
  assert "[lit] done: 4 steps" in log and "zero-shot top-1" in log
  assert "\r" not in log

  # A structural change: one line, naming the key, before any work.
  r = _run(work, data, "--config.total_steps=4", "--config.loss.name=sigmoid")
  assert r.returncode == 2, r.stderr[-3000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: workdir "), lines
  assert "loss.name ('softmax' -> 'sigmoid')" in lines[0]
  assert "use a new --workdir, or resume anyway with " in lines[0]
  assert "Traceback" not in r.stderr

  # Resumed despite the change: the checkpoint does not fit the sigmoid
  # head's train state; one line naming the checkpoint, not orbax's
  # tree-structure error. The workdir's record is left as it was.
  recorded = (work / "config.json").read_text()
  r = _run(work, data, "--config.total_steps=5", "--config.loss.name=sigmoid",
           "--config.resume_despite_changes=True")
  assert r.returncode == 2, r.stderr[-3000:]
  assert "[lit] resuming" in r.stdout and "loss.name" in r.stdout
  lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
  assert len(lines) == 1 and "does not fit this config's train state" in (
      lines[0]) and str(work / "checkpoints") in lines[0], r.stderr[-3000:]
  assert "Traceback" not in r.stderr
  assert (work / "config.json").read_text() == recorded
  assert len((work / "command.txt").read_text().splitlines()) == 2

  # A harmless change (more steps, another eval cadence) resumes.
  r = _run(work, data, "--config.total_steps=6", "--config.eval.every_steps=3")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from the checkpoint of step 4" in r.stdout
  assert "resuming" not in r.stdout  # No note for free keys.
  with open(work / "config.json") as f:
    assert json.load(f)["total_steps"] == 6
  assert len((work / "command.txt").read_text().splitlines()) == 4
  # train.log holds every run that got past its config check, the refused
  # one and the one that could not resume too (with their errors).
  log = (work / "train.log").read_text()
  assert log.count("# run started") == 4 and "[lit] done: 4 steps" in log
  assert "loss.name ('softmax' -> 'sigmoid'); use a new --workdir" in log
  assert "does not fit this config's train state" in log
  assert "[lit] done: 6 steps in" in log

  # Checkpoints kept outside the workdir: load_params finds them through
  # config.json.
  from train import train as train_lib  # pylint: disable=g-import-not-at-top
  elsewhere = tmp_path / "elsewhere"
  r = _run(tmp_path / "w2", data, "--config.total_steps=2",
           f"--config.checkpoint.directory={elsewhere}")
  assert r.returncode == 0, r.stderr[-3000:]
  assert not (tmp_path / "w2" / "checkpoints").exists()
  assert sorted(os.listdir(elsewhere)) == ["2"]
  assert set(train_lib.load_params(str(tmp_path / "w2"))) == {
      "img", "txt", "head"}


def test_secrets_never_reach_the_workdir(tmp_path):
  """A URL's user:password@, a signed URL's query string and credentials in
  storage options are redacted in config.json and command.txt."""
  config = _tiny()
  config.data.name = ("webdataset:https://user:hunter2@host/s-{0..3}.tar"
                      "?X-Amz-Signature=abc123&X-Amz-Credential=AKIA")
  config.data.storage_options = json.dumps({"s3": {
      "key": "AKIA", "secret": "s3cr3t", "token": "t0k",
      "endpoint_url": "http://127.0.0.1:9000"}})
  main = os.path.join(ROOT, "train", "main.py")
  command = workdir_lib.command_line(
      [main, f"--config.data.name={config.data.name}",
       f"--config.data.storage_options={config.data.storage_options}"])
  workdir_lib.record_run(str(tmp_path), config, command)
  written = ((tmp_path / "config.json").read_text()
             + (tmp_path / "command.txt").read_text())
  for secret in ("hunter2", "abc123", "AKIA", "s3cr3t", "t0k"):
    assert secret not in written, secret
  recorded = json.loads((tmp_path / "config.json").read_text())
  assert recorded["data"]["name"] == (
      "webdataset:https://***@host/s-{0..3}.tar?***")
  assert json.loads(recorded["data"]["storage_options"]) == {"s3": {
      "key": "***", "secret": "***", "token": "***",
      "endpoint_url": "http://127.0.0.1:9000"}}
  # A rerun with a re-signed URL is the same data.
  config.data.name = "webdataset:https://user:hunter2@host/s-{0..3}.tar?X=1"
  workdir_lib.check_resume(str(tmp_path), config, log=None)
