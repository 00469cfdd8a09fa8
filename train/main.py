"""Command line: ``.venv/bin/python -m train.main --config configs/lit_demo.py
--workdir DIR`` (the interpreter of the environment that
``scripts/setup_env.sh`` builds; ``python`` once it is activated).

``--config`` takes a config file and an optional argument after a colon
(``configs/lit_demo.py:tiny``); ``--config.<key>=<value>`` overrides any key.
Running the same command again resumes from the newest checkpoint in DIR.

Multi-process (one process per host or per GPU): the same command in every
process with ``--jax_distributed``; outside a detected cluster (SLURM, Open
MPI, ...) also ``--coordinator_address=HOST:PORT --num_processes=N
--process_id=P``. Process P reads shard P of the data.

Usage errors (a missing config file, unknown config keys, a workdir that is
not a writable directory, missing dataset or checkpoint files, a batch that
does not fit the devices) print one ``error: ...`` line and exit with status
2 instead of a traceback (set INFCL_TRACEBACK=1 to see it).

XLA flags: the ring's recommended GPU flags (``infcl_jax.xla_flags``) are
added to XLA_FLAGS at start-up, before JAX starts its backends; flags already
in XLA_FLAGS are kept.

Ctrl-C finishes the checkpoint being written (Ctrl-C again abandons it),
prints "interrupted at step N; last checkpoint step M; rerun to resume" and
exits with status 130. A rerun of a finished run trains nothing and says so;
``--reevaluate`` evaluates its final checkpoint again.

Preemption: SIGTERM and SIGUSR1 (``config.preemption_signals``) let the step
in progress finish; a checkpoint of it is saved, "[lit] preempted at step N;
checkpoint saved; rerun to resume" is printed and the exit status is 75
(EXIT_PREEMPTED, sysexits' EX_TEMPFAIL): rerun the same command to resume.
A signal before the first step (start-up, indexing, the precompute pass,
compilation) stops the run at the next safe point, with the precompute
progress kept ("[lit] preempted before step N (...)"), also with 75. With
several processes, a signal to any one of them stops all of them at the
same step (train/preemption.py, docs/cluster.md).

Storage outages: remote reads are retried for config.data.remote_outage_s
(15 minutes); past it the step reached is saved, one "[lit] storage
outage ..." line names the URL and the budget, and the exit status is 75
too. A permanent error (403, 404, a deleted shard) is a one-line error, 2.

The workdir records each run: config.json (the resolved config), command.txt
(the command lines) and train.log (what process 0 printed).
"""
from __future__ import annotations

import os
import re
import sys
import traceback

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from train import preemption
from train import workdir as workdir_lib

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py), optionally with ':arg'.",
    lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here; "
                    "an existing workdir is resumed.")
flags.DEFINE_bool("reevaluate", False, "When the workdir holds a run "
                  "finished at config.total_steps: evaluate its final "
                  "checkpoint again and update summary.json (otherwise a "
                  "rerun of a finished run only prints its summary).")
flags.DEFINE_bool("jax_distributed", False, "Multi-process run: call "
                  "jax.distributed.initialize() (cluster auto-detected: SLURM, "
                  "Open MPI, ...) before anything else; each process then "
                  "reads its own shard of the data.")
flags.DEFINE_string("coordinator_address", None, "With --jax_distributed "
                    "outside a detected cluster: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "With --jax_distributed outside "
                     "a detected cluster: the number of processes.")
flags.DEFINE_integer("process_id", None, "With --jax_distributed outside a "
                     "detected cluster: this process's id in "
                     "[0, num_processes).")

# Errors that describe a bad invocation, not a bug: reported in one line.
USAGE_ERRORS = (ValueError, FileNotFoundError, KeyError, AttributeError,
                TypeError)


def _error(msg) -> None:
  print(f"error: {msg}", file=sys.stderr, flush=True)
  sys.exit(2)


def _unknown_key_message(e: Exception, argv) -> str | None:
  """One line for ml_collections' "unknown key" error of an override.

  ``--config.batchsize=8`` raises an AttributeError wrapping a KeyError whose
  message is the quoted key, a newline, and ``Did you mean "batch_size"
  instead of "batchsize"?``.
  """
  inner = e.args[0] if e.args else ""
  if isinstance(inner, BaseException):
    inner = inner.args[0] if inner.args else ""
  if not isinstance(inner, str):
    return None
  first, _, rest = inner.partition("\n")
  key = first.strip().strip("'\"")
  if not key or " " in key:
    return None
  hint = re.search(r'Did you mean "([^"]+)"', rest)
  flag = next((a.split("=")[0] for a in argv[1:] if a.startswith("--config.")
               and key in a.split("=")[0].split(".")), None)
  return (f"{flag or 'config'}: unknown config key {key!r}"
          + (f" (did you mean {hint.group(1)!r}?)" if hint else "")
          + "; train/config_base.py lists the trainer's keys, "
          "train/data/config.py the data and tokenizer keys")


def _parse_flags(argv):
  try:
    return FLAGS(argv)
  except (AttributeError, KeyError) as e:  # Unknown key in an override.
    msg = _unknown_key_message(e, argv)
    _error(msg or f"{type(e).__name__}: {e}".splitlines()[0])
  except flags.Error as e:
    # config_flags wraps errors raised in a config file: keep the cause too.
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    _error(" ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
           or type(e).__name__)
  except (*USAGE_ERRORS, SyntaxError) as e:  # Config files, overrides.
    _error(f"{type(e).__name__}: {e}".splitlines()[0])


def _distributed_args() -> dict:
  names = ("coordinator_address", "num_processes", "process_id")
  return {n: FLAGS[n].value for n in names if FLAGS[n].value is not None}


def _check_distributed_flags() -> None:
  """One line for an inconsistent set of multi-process flags."""
  kw = _distributed_args()
  if not FLAGS.jax_distributed:
    if kw:
      _error(f"--{next(iter(kw))} needs --jax_distributed")
    return
  if kw and len(kw) != 3:
    missing = sorted({"coordinator_address", "num_processes", "process_id"}
                     - set(kw))
    _error(f"--jax_distributed with explicit flags needs all three of "
           f"--coordinator_address, --num_processes, --process_id (missing "
           f"--{', --'.join(missing)})")
  if kw and not 0 <= kw["process_id"] < kw["num_processes"]:
    _error(f"--process_id={kw['process_id']} must be in [0, "
           f"--num_processes={kw['num_processes']})")


def _set_xla_flags() -> None:
  """The ring's recommended GPU flags (``infcl_jax.xla_flags``), before JAX
  starts its backends: XLA reads them once. Flags already in XLA_FLAGS are
  kept; if JAX has started already, say so and go on without them."""
  # Lazy: infcl_jax imports JAX, which comes after the signals are caught.
  from infcl_jax import xla_flags  # pylint: disable=g-import-not-at-top
  try:
    xla_flags.apply()
  except RuntimeError as e:
    print(f"[lit] warning: {e}", file=sys.stderr, flush=True)


def _init_distributed() -> None:
  """jax.distributed.initialize with the explicit flags, if any.

  On a detected cluster (SLURM, Open MPI, ...) no flag is needed; elsewhere
  (e.g. several processes on one machine) all three must be given.
  """
  kw = _distributed_args()
  # Lazy (as JAX is everywhere here): after the signals are caught.
  import jax  # pylint: disable=g-import-not-at-top
  try:
    jax.distributed.initialize(**kw)
  except (ValueError, RuntimeError) as e:
    # E.g. no cluster detected and no flags: say what to pass.
    if os.environ.get("INFCL_TRACEBACK"):
      raise
    _error(f"jax.distributed.initialize failed: "
           f"{str(e).splitlines()[0] if str(e) else type(e).__name__} (outside "
           f"a detected cluster pass --coordinator_address, --num_processes "
           f"and --process_id)")


def _config():
  """FLAGS.config, or one line if the config file could not be loaded."""
  config = FLAGS.config
  try:
    if config is not None:
      config.keys()  # A file that failed to load raises here, not at parsing.
    return config
  except OSError as e:
    name = FLAGS["config"].config_filename or ""
    if name and not os.path.exists(name):
      _error(f"--config {name}: no such config file (e.g. --config "
             "configs/lit_demo.py)")
    cause = e.__cause__ or e
    _error(f"--config {name}: cannot load it: "
           f"{str(cause).strip().splitlines()[-1].strip()}")


def main(argv) -> None:
  # What the run prints goes to <workdir>/train.log too (once the config
  # has been validated and the workdir made).
  run_log = workdir_lib.RunLog.capture()
  try:
    _main(argv)
  except Exception:  # A crash: its traceback (printed by absl) in the log too.
    run_log.log_only(traceback.format_exc())
    raise
  finally:
    run_log.close()


def _main(argv) -> None:
  if len(argv) > 1:
    _error(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _config()
  if config is None:
    _error("--config is required, e.g. --config configs/lit_demo.py")
  if not FLAGS.workdir:
    _error("--workdir is required")
  _check_distributed_flags()
  try:
    # Before any work, creating nothing: the workdir is made once the
    # config has been validated (train.train_and_evaluate).
    workdir_lib.check_workdir(FLAGS.workdir, create=False)
    signals = config.get("preemption_signals", ())
    preemption.check_signal_names(signals)
  except ValueError as e:
    _error(str(e))
  # From the start: a preemption while JAX starts (or later, before the
  # first step) stops the run at the trainer's next safe point, not lost.
  preemption.catch(signals)
  if not FLAGS["verbosity"].present:
    # orbax logs every save at INFO; the trainer's own progress is printed.
    logging.set_verbosity(logging.WARNING)
  _set_xla_flags()
  if FLAGS.jax_distributed:
    # JAX's preemption service installs a C++ SIGTERM handler of its own:
    # off, so that no signal reaches it (the trainer's agreement does its
    # work; orbax reads it as "no preemption"). (Lazy: see _init_distributed.)
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_enable_preemption_service", False)
    _init_distributed()
    # jax.distributed installs its own SIGTERM handler (its preemption
    # notifier): the trainer's agreement replaces it (train/preemption.py).
    preemption.catch(signals)
  # Lazy, here and below: the trainer and its data import JAX and take
  # seconds, once the signals are caught (a preemption meanwhile is recorded).
  from train.data.sources import remote  # pylint: disable=g-import-not-at-top
  try:
    try:
      from train import train  # pylint: disable=g-import-not-at-top
      train.train_and_evaluate(config, FLAGS.workdir,
                               reevaluate=FLAGS.reevaluate,
                               command=workdir_lib.command_line(sys.argv))
    except remote.Outage as e:
      # Outside the training loop (start-up, the final evaluation): nothing
      # more to save than what is saved (the loop saves the step reached).
      if os.environ.get("INFCL_TRACEBACK"):
        raise
      print(f"[lit] storage outage: {e}; rerun to resume", flush=True)
      raise preemption.Preempted(None, "storage outage") from None
  except preemption.Preempted:
    # The checkpoint of the step reached is complete and the message is
    # printed. Exit at once (the grace period is short), after leaving the
    # other processes cleanly.
    sys.stdout.flush()
    sys.stderr.flush()
    if FLAGS.jax_distributed:
      try:
        import jax  # pylint: disable=g-import-not-at-top  (lazy: as above)
        jax.distributed.shutdown()
      except Exception:  # pylint: disable=broad-except
        pass
    if workdir_lib.RunLog.active is not None:
      workdir_lib.RunLog.active.close()
    os._exit(preemption.EXIT_PREEMPTED)  # pylint: disable=protected-access
  except (ValueError, FileNotFoundError, MemoryError) as e:
    # MemoryError: train.memory.OutOfMemory, an allocation that failed.
    if os.environ.get("INFCL_TRACEBACK"):
      raise
    _error(str(e).splitlines()[0] if str(e) else type(e).__name__)
  except KeyboardInterrupt as e:
    if not getattr(e, "reported", False):
      print("\n[lit] interrupted before training started; rerun to start",
            flush=True)
    # train_and_evaluate has finished (or abandoned) the checkpoint in flight
    # and said where to resume. Exit at once: a normal interpreter exit would
    # wait for (or abort) threads that the interrupt left behind.
    sys.stdout.flush()
    sys.stderr.flush()
    if workdir_lib.RunLog.active is not None:
      workdir_lib.RunLog.active.close()
    os._exit(130)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
