"""README's LiT recipe, run as written, end to end.

The train command is taken from README.md between ``<!-- recipe:start -->``
and ``<!-- recipe:end -->``; ``:user`` becomes ``:user_small`` (the CPU smoke
run) and the user's paths become fixtures of the same kind: an HF CLIP
checkpoint with its tokenizer.json (tests/fixtures/towers), webdataset
shards with a json ``label``, a held-out shard and a class-name file. The run
must train the locked tower's LiT and report zero-shot and retrieval on the
held-out shard.
"""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests import lit_fixtures

ROOT = lit_fixtures.ROOT
README = os.path.join(ROOT, "README.md")


def recipe_command() -> list[str]:
  """The argv of the bash block between the recipe markers of README."""
  with open(README, encoding="utf-8") as f:
    text = f.read()
  m = re.search(r"<!-- recipe:start -->\s*```bash\n(.*?)```\s*"
                r"<!-- recipe:end -->", text, re.S)
  assert m, "README.md has no ```bash block between the recipe markers"
  return shlex.split(m.group(1).replace("\\\n", " "))


def test_the_recipe_block_is_the_agreed_command():
  argv = recipe_command()
  assert argv[:3] == [".venv/bin/python", "-m", "train.main"], argv
  args = dict(a.split("=", 1) for a in argv[3:] if "=" in a)
  assert argv[argv.index("--config") + 1] == "configs/lit_pretrained.py:user"
  assert set(args) == {"--config.model.image.init", "--config.data.name",
                       "--config.data.eval_split",
                       "--config.data.zeroshot_classnames_file"}, args
  assert args["--config.data.name"].startswith("webdataset:")
  assert args["--config.data.eval_split"].startswith("webdataset:")


def _swap(argv, paths) -> list[str]:
  """The recipe with :user_small, this interpreter and the fixtures' paths;
  anything else the block holds is passed on as it is."""
  out = [sys.executable] + argv[1:]
  for i, a in enumerate(out):
    if a == "--config":
      out[i + 1] = out[i + 1].replace(":user", ":user_small")
    elif a == "--workdir":
      out[i + 1] = paths["workdir"]
    elif a.startswith("--") and "=" in a:
      key, _ = a.split("=", 1)
      if key in paths:
        out[i] = f"{key}={paths[key]}"
  return out


@pytest.mark.slow
def test_the_readme_recipe_runs_end_to_end(tmp_path):
  ckpt = lit_fixtures.checkpoint(tmp_path)
  train = lit_fixtures.shards(tmp_path / "data", "train", num=48)
  val = lit_fixtures.shards(tmp_path / "data", "val", num=16, split="test",
                            seed=1)
  work = tmp_path / "runs" / "lit_mine"
  cmd = _swap(recipe_command(), {
      "workdir": str(work),
      "--config.model.image.init": ckpt,
      "--config.data.name": "webdataset:" + train.pattern,
      "--config.data.eval_split": "webdataset:" + val.pattern,
      "--config.data.zeroshot_classnames_file":
          lit_fixtures.classnames(tmp_path / "data")})
  assert cmd[cmd.index("--config") + 1].endswith(":user_small")
  r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT,
                                             JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
  out = r.stdout
  assert "image tower pretrained locked" in out, out
  assert re.search(r"\[lit\] zero-shot eval: 16 images of webdataset:.*"
                   r"8 classes \(names from .*classnames.txt\)", out), out
  assert re.search(r"\[lit\] zero-shot top-1 .* on the held-out split", out)
  assert "[lit] retrieval R@1/5/10 image->text" in out
  with open(work / "summary.json") as f:
    summary = json.load(f)
  for k in ("eval/zeroshot_top1", "eval/zeroshot_top5", "eval/i2t_r1",
            "eval/t2i_r1"):
    assert 0.0 <= summary[k] <= 1.0, (k, summary)
  assert summary["eval/retrieval_num_images"] == 16
  assert summary["data/bad_examples"] == 0
