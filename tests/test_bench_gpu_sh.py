"""scripts/gpu.sh on the CPU: its suites, the plan it would run (--dry-run),
and that every BENCHMARKS.md command names a suite and part it has."""
import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu.sh")
SUITES = ("verify", "tests", "loss", "towers", "train", "data", "ring")


def _sh(*args):
  return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True,
                        cwd=ROOT, timeout=60, check=False,
                        env=dict(os.environ, OUT="/tmp/gpu_sh_plan"))


def _jobs(stdout):
  return [l for l in stdout.splitlines() if re.match(r"[\w-]+ \[\d+ s\]: ", l)]


def _parts():
  """{suite: {part: box_s}} from --list."""
  p = _sh("--list")
  assert p.returncode == 0, p.stderr
  out = {}
  for line in p.stdout.splitlines():
    suite, rest = line.split(":", 1)
    out[suite] = {m[0]: int(m[1]) for m in re.findall(r"(\w+) \((\d+) s\)", rest)}
  return out


def test_syntax_and_the_one_gpu_script():
  assert subprocess.run(["bash", "-n", SCRIPT], check=False).returncode == 0
  scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "scripts"))
                   if f.startswith("gpu"))
  assert scripts == ["gpu.sh"]


def test_suites_and_boxes_fit_a_device_call():
  parts = _parts()
  assert tuple(parts) == SUITES
  for suite, boxes in parts.items():
    assert boxes, suite
    # One device call runs at most 10 minutes, start-up included.
    assert all(0 < b <= 580 for b in boxes.values()), (suite, boxes)


@pytest.mark.parametrize("suite", SUITES)
def test_dry_run_plan_names_existing_files_under_each_box(suite):
  p = _sh("--dry-run", suite)
  assert p.returncode == 0, p.stderr
  jobs = _jobs(p.stdout)
  assert jobs, p.stdout
  boxes = _parts()[suite]
  for line in jobs:
    name = line.split(" ", 1)[0]
    assert name.startswith(suite + "-"), line
    for path in re.findall(r"\b((?:benchmarks|tests)/[\w/]+\.py)\b", line):
      assert os.path.exists(os.path.join(ROOT, path)), line
    script = re.search(r"\b(benchmarks/\w+\.py)\b", line)
    if script:  # Every option the plan passes is one the script takes.
      with open(os.path.join(ROOT, script[1]), encoding="utf-8") as f:
        src = f.read()
      known = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", src))
      # The shared options a script asks harness.parser for, by name.
      for call in re.findall(r"harness\.parser\(([^)]*)\)", src):
        known |= {harness.SHARED[n][0] for n in re.findall(r"(\w+)=", call)}
      used = set(re.findall(r"\s(--[a-z][\w-]*)", line.split(script[1], 1)[1]))
      assert used <= known, (line, sorted(used - known))
    # Results go under $OUT, where the device call returns them from.
    for out in re.findall(r"--out (\S+)", line):
      assert out.startswith("/tmp/gpu_sh_plan/"), line
  # The jobs of a part share its box: run one after another, their boxes
  # add up to at most the suite's; tests-pallas and tests-triton run beside
  # tests-mosaic, in the same box.
  # verify-step runs beside verify-exact likewise.
  total = sum(int(re.search(r"\[(\d+) s\]", l)[1]) for l in jobs
              if not l.startswith(("tests-pallas", "tests-triton",
                                   "verify-step")))
  assert total <= sum(boxes.values()), (total, boxes)


def test_parts_select_and_bad_names_fail_in_one_line():
  p = _sh("--dry-run", "loss", "stages")
  assert p.returncode == 0
  jobs = _jobs(p.stdout)
  assert [j.split(" ")[0] for j in jobs] == ["loss-stages-bf16", "loss-stages-f32"]
  for args, word in ((("nope",), "unknown suite 'nope'"),
                     (("loss", "nope"), "no part 'nope'")):
    p = _sh("--dry-run", *args)
    assert p.returncode == 2 and word in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_every_benchmarks_md_command_is_a_suite_part():
  text = open(os.path.join(ROOT, "BENCHMARKS.md")).read()
  cited = re.findall(r"scripts/gpu\.sh ([a-z]+)((?: [a-z0-9]+)*)", text)
  assert cited
  parts = _parts()
  for suite, rest in cited:
    assert suite in parts, suite
    for part in rest.split():
      assert part in parts[suite], (suite, part)


def test_results_are_the_raw_rows_behind_benchmarks_md():
  """benchmarks/results/ holds raw rows only (CSV, JSON, JSONL), at most 40
  files, each behind a BENCHMARKS.md table (a *_meta.json beside its CSV),
  and every file BENCHMARKS.md links there exists."""
  text = open(os.path.join(ROOT, "BENCHMARKS.md")).read()
  results = os.path.join(ROOT, "benchmarks", "results")
  names = sorted(os.listdir(results))
  assert 0 < len(names) <= 40, len(names)
  for name in names:
    assert os.path.isfile(os.path.join(results, name)), name
    assert name.endswith((".csv", ".json", ".jsonl")), name
    cited = re.sub(r"_meta\.json$", ".csv", name)
    assert f"benchmarks/results/{cited}" in text, name
  for link in re.findall(r"\]\((benchmarks/results/[^)]+)\)", text):
    assert os.path.exists(os.path.join(ROOT, link)), link


def test_the_gpu_decoder_variants_the_script_passes_parse():
  # A typo in a variant would be found only on the device, a case later.
  from benchmarks import bench_train  # pylint: disable=import-outside-toplevel
  text = open(SCRIPT, encoding="utf-8").read()
  defaults = re.findall(r'--gpu_variants "\$\{GPU_VARIANTS:-([^}]*)\}"', text)
  assert any(defaults), defaults
  for d in defaults:
    assert bench_train.gpu_variants(d), d


def _verify_plan(**env):
  p = subprocess.run(["bash", SCRIPT, "--dry-run", "verify"],
                     capture_output=True, text=True, cwd=ROOT, timeout=60,
                     check=False, env=dict(os.environ, OUT="/tmp/gpu_sh_plan",
                                           **env))
  assert p.returncode == 0, p.stderr
  return p.stdout


def test_verify_plans_its_ab_against_the_reference_commit():
  """``gpu.sh --dry-run verify``: the exactness grid and the decoder step,
  then the A/B of this checkout against the last commit that passed
  (scripts/verify-passed.txt) or VERIFY_REF, with where its tree comes
  from; the whole fits one device call."""
  last = [l.split()[0] for l in open(os.path.join(
      ROOT, "scripts", "verify-passed.txt")) if l.strip()
          and not l.startswith("#")][-1]
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                        capture_output=True, text=True, check=True).stdout
  plan = _verify_plan()
  names = [j.split(" ")[0] for j in _jobs(plan)]
  assert names == ["verify-exact", "verify-step", "verify-speed"], plan
  ab = [l for l in plan.splitlines() if l.startswith("verify-speed A/B: ")]
  assert len(ab) == 1, plan
  assert f"A = this checkout ({head.strip()}" in ab[0], ab
  assert f"B = {last} (" in ab[0] and "order A B A B" in ab[0], ab
  assert "--ref-name " + last in plan
  assert "B = 94cc2be (" in _verify_plan(VERIFY_REF="94cc2be")
  exact = [l for l in _jobs(plan) if l.startswith("verify-exact")][0]
  assert "-m gpu" in exact and "tests/test_gpu_verify.py" in exact
  parts = _parts()["verify"]
  assert max(parts["exact"], parts["step"]) + parts["speed"] <= 540, parts


def test_ab_bench_times_each_tree_interleaved(tmp_path):
  """benchmarks/bench_ab.py on the CPU: worker B imports infcl_jax from the
  reference tree (not this checkout), both sides are timed the asked
  number of calls, and the table and JSON come out."""
  import shutil  # pylint: disable=import-outside-toplevel
  from benchmarks import bench_ab  # pylint: disable=import-outside-toplevel
  ref = tmp_path / "ref"
  shutil.copytree(os.path.join(ROOT, "infcl_jax"), ref / "infcl_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  out = tmp_path / "out"
  p = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_ab.py"),
       "--ref-tree", str(ref), "--ref-name", "copy",
       "--cases", "softmax:float32:96", "--rounds", "2", "--calls", "2",
       "--slower", "10", "--out", str(out)],
      capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
  assert p.returncode == 0, p.stdout + p.stderr[-2000:]
  result = json.loads((out / "bench_ab.json").read_text())
  assert result["A"]["infcl_jax"] == os.path.join(ROOT, "infcl_jax")
  assert result["B"]["infcl_jax"] == str(ref / "infcl_jax")
  case = result["cases"]["softmax:float32:96"]
  assert len(case["A"]) == len(case["B"]) == 4 and case["verdict"] == "ok"
  assert "softmax:float32:96" in p.stdout.splitlines()[-1]
  assert bench_ab.compare([1.04, 1.05], [1.0, 1.0], 0.03)[3] == "SLOWER"
  assert bench_ab.compare([1.02, 1.03], [1.0, 1.0], 0.03)[3] == "ok"
