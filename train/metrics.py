"""What a run logs: metrics.jsonl and TensorBoard, the progress bar, and its
evaluation and summary lines (docs/training.md, "What is logged").
"""
from __future__ import annotations

import json
import os
from typing import Callable

from absl import logging

from train.eval import zeroshot as zeroshot_lib


TB_FLUSH_S = 10


class MetricWriter:
  """metrics.jsonl (one JSON object per line) + TensorBoard scalars.

  ``on_write(step, row)``, if given, is called after each row is written (the
  notebook redraws its live loss curve from it).
  """

  def __init__(self, workdir: str, start_step: int, enabled: bool = True,
               on_write: Callable[[int, dict], None] | None = None):
    self.enabled = enabled
    self.on_write = on_write
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    if not enabled:
      return
    # A resumed run drops the lines a killed run wrote after its checkpoint,
    # so the file reads like one uninterrupted run.
    if os.path.exists(self.path):
      with open(self.path) as f:
        keep = [l for l in f if l.strip() and
                json.loads(l).get("step", 0) <= start_step]
      with open(self.path, "w") as f:
        f.writelines(keep)
    try:
      # Lazy and optional: ~0.4 s, and only process 0 writes scalars.
      import tensorboardX  # pylint: disable=g-import-not-at-top
      # Written by tensorboardX's thread every flush_secs and at close, not
      # flushed per row: its flush fsyncs (0.1-1 s on a slow or network
      # disk, in the training loop). metrics.jsonl is the record.
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tb"),
                                            flush_secs=TB_FLUSH_S)
    except ImportError:
      logging.warning("tensorboardX not installed: no TensorBoard scalars")

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(k, float(v), step)
    if self.on_write is not None:
      self.on_write(int(step), row)

  def close(self):
    if self._tb is not None:
      self._tb.close()


def progress_bar(config, total, initial, enabled):
  """A tqdm bar of the steps on process 0 when config.progress_bar asks for
  one and tqdm is there, else None."""
  if not (config.progress_bar and enabled):
    return None
  try:  # Lazy and optional: only process 0 shows a bar, if asked.
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
              smoothing=0.1)


def eval_line(step: int, m: dict) -> str:
  """One console line for an evaluation in the middle of a run."""
  parts = []
  if "zeroshot_top1" in m:
    parts.append("zero-shot " + zeroshot_lib.describe(m))
  if "i2t_r1" in m:
    parts.append(f"retrieval R@1 image->text {100 * m['i2t_r1']:.1f}%, "
                 f"text->image {100 * m['t2i_r1']:.1f}%")
  return f"[lit] eval at step {step}: " + ("; ".join(parts) or "no eval sets")


def print_summary(s: dict, done_line: bool = True) -> None:
  """The summary lines of a run (``summary.json``'s numbers) on stdout."""
  lines = []
  if done_line:
    lines.append(f"[lit] done: {s['steps']} steps in {s['wall_s']:.0f}s"
                 + (f" (resumed from step {s['resumed_from']})"
                    if s["resumed_from"] else ""))
  if "loss" in s:
    lines.append(f"[lit] final train loss {s['loss']:.4f}, temperature "
                 f"{s['temperature']:.4f}")
  if "data/skipped_by_reason" in s:
    reasons = s["data/skipped_by_reason"]
    n = sum(reasons.values())
    lines.append(
        "[lit] training data: "
        + (f"{n} bad example(s) skipped ("
           + ", ".join(f"{k}: {v}" for k, v in reasons.items()) + ")"
           if n else "no bad example skipped")
        + f"; {s.get('data/retries_all_processes', 0)} remote read(s) "
        "retried")
  if "eval/zeroshot_top1" in s:
    lines.append("[lit] zero-shot " + zeroshot_lib.describe(s, "eval/")
                 + " on the held-out split")
  if "eval/i2t_r1" in s:
    lines.append("[lit] retrieval R@1/5/10 image->text "
                 + "/".join(f"{100 * s[f'eval/i2t_r{k}']:.1f}"
                            for k in (1, 5, 10))
                 + ", text->image "
                 + "/".join(f"{100 * s[f'eval/t2i_r{k}']:.1f}"
                            for k in (1, 5, 10)))
  print("\n".join(lines), flush=True)
