"""The README's picture of the B x B memory wall, from benchmark results.

Reads benchmarks/results/softmax_bench_loss.csv (written by bench_loss.py on
the GPU) and draws the measured device memory of one loss + gradients step
for the full-matrix loss and the tiled Pallas kernels, next to the size of a
single float32 B x B matrix (a formula, drawn as a dashed line) and the
H200's 141 GB. Writes docs/memory_wall.png.

  python benchmarks/plot_readme.py
"""
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSV = os.path.join(ROOT, "benchmarks", "results", "softmax_bench_loss.csv")
OUT = os.path.join(ROOT, "docs", "memory_wall.png")


def main():
  rows = [r for r in csv.DictReader(open(CSV))
          if r["status"] == "ok" and r["dtype"] == "bfloat16"]
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  labels = {"reference": "full B×B matrix (measured)",
            "xla": "infcl-jax, tiled XLA (measured)",
            "pallas": "infcl-jax, Pallas kernels (measured)"}
  for backend, style in (("reference", "o-"), ("xla", "s-"), ("pallas", "D-")):
    pts = sorted((int(r["B"]), float(r["peak_extra_gb"]))
                 for r in rows if r["backend"] == backend)
    if pts:
      ax.loglog(*zip(*pts), style, label=labels[backend])
  bs = [2**k for k in range(13, 21)]
  ax.loglog(bs, [b * b * 4 / 1e9 for b in bs], "k--", lw=1,
            label="one float32 B×B matrix (B²·4 bytes)")
  ax.axhline(141, color="tab:red", lw=1)
  ax.text(bs[0], 160, "H200 memory (141 GB)", color="tab:red", fontsize=8)
  ax.set(xlabel="batch size B (D = 768, bf16, loss + gradients)",
         ylabel="device memory beyond inputs (GB)",
         title="The B×B memory wall of contrastive losses")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8, loc="upper left")
  fig.tight_layout()
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  fig.savefig(OUT, dpi=120)
  print(OUT)


if __name__ == "__main__":
  main()
