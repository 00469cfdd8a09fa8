"""The workdir check, before any work (no heavy imports: ``train.main`` runs it
before it imports JAX)."""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
import threading
import time

from absl import logging as absl_logging


def _nearest_existing(path: str) -> str:
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path


def check_workdir(workdir: str, *, create: bool = True) -> None:
  """One-line ValueError unless ``workdir`` is (or can be created as) a
  writable directory.

  With ``create=False`` nothing is made: the directory, or the nearest
  existing folder above it, must be a writable directory. ``train.main``
  checks so at start-up, and the directory is created (``create=True``)
  only once the config has been validated, so a run that fails its checks
  leaves no empty workdir behind.
  """
  if not workdir:
    raise ValueError("the workdir is empty: pass --workdir DIR")
  if "://" in workdir:
    raise ValueError(
        f"workdir {workdir}: a workdir is a local or mounted directory (its "
        "logs, metrics and config are files); put the checkpoints on object "
        "storage with --config.checkpoint.directory=gs://BUCKET/PATH (or "
        "s3://BUCKET/PATH; docs/cluster.md)")
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"workdir {workdir} is an existing file, not a "
                     "directory: pass a directory (new or existing) as "
                     "--workdir")
  if not create:
    base = _nearest_existing(path)
    if not os.path.isdir(base):
      raise ValueError(f"workdir {workdir} cannot be created: Not a "
                       f"directory ({base})")
    if base != path and not os.access(base, os.W_OK | os.X_OK):
      raise ValueError(f"workdir {workdir} cannot be created: Permission "
                       f"denied ({base})")
    if base == path:
      _probe(workdir, path)
    return
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"workdir {workdir} cannot be created: "
                     f"{e.strerror or e} ({e.filename or path})") from None
  _probe(workdir, path)


def _probe(workdir: str, path: str) -> None:
  try:  # os.access can pass on a read-only mount; a real write cannot.
    fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"workdir {workdir} is not writable: "
                     f"{e.strerror or e}") from None


# ------------------------------------------------------- the run's record
#
# A workdir holds, beside checkpoints and metrics:
#   config.json   the resolved config of the latest run (all keys);
#   command.txt   every run's command line, one per line after a "# <UTC
#                 time>" line (appended by each rerun);
#   train.log     what the runs printed (stdout and stderr; with several
#                 processes, process 0's), appended by each rerun.
# A rerun checks its config against config.json first (``check_resume``).

CONFIG_FILE = "config.json"
COMMAND_FILE = "command.txt"
LOG_FILE = "train.log"

# Keys that may change between the runs of one workdir without a word: how
# long, how often to evaluate, log and checkpoint, the held-out sets, and
# how the data is read (not which data).
_FREE = ("total_steps", "log_every_steps", "progress_bar", "eval.",
         "checkpoint.every_steps", "checkpoint.every_minutes",
         "checkpoint.keep", "preemption_signals", "resume_despite_changes",
         "data.eval_split", "data.num_eval_examples", "data.zeroshot_",
         "data.num_threads", "data.num_workers", "data.prefetch_batches",
         "data.cache_max_mb", "data.gpu_decoder_cpu_threads",
         "data.storage_options", "data.remote_outage_s",
         "data.remote_retries",
         "data.shard_index_cache", "device_memory_gb")
# Keys that change the numbers from here on but neither the train state's
# structure nor the data stream: a one-line note, and the run goes on.
_NOTED = ("optim.lr", "optim.weight_decay", "optim.weight_decay_scale",
          "optim.b1", "optim.b2", "optim.eps", "optim.warmup_steps",
          "optim.end_lr_ratio", "optim.grad_clip_norm", "optim.lr_mults",
          "optim.adafactor_decay_rate", "optim.adafactor_eps",
          "optim.adafactor_clipping_threshold", "loss.backend",
          "loss.block_q", "loss.block_k", "loss.min_log_scale",
          "loss.max_log_scale", "loss.init_log_scale", "loss.init_bias",
          "model.dtype", "data.data_dir", "data.decoder",
          "data.gpu_decoder_backend", "data.gpu_decoder_options",
          "data.max_bad_fraction", "checkpoint.directory",
          "microbatch_size", "model.text.remat", "loss.dtype")
# Every other key (the seed, the batch, the towers, the loss and its head,
# the optimizer's kind, the data and the tokenizer) changes the train
# state's structure or the data stream: the rerun stops unless
# config.resume_despite_changes is set.


def _matches(key: str, names) -> bool:
  return any(key == n or (n.endswith((".", "_")) and key.startswith(n))
             for n in names)


def flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


# Secrets a config or a command line may carry: a URL's user:password@, a
# signed URL's query string, credentials in storage options. They are never
# written to the workdir.
_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]+@")
_QUERY = re.compile(r"((?:https?|s3|gs)://[^\s?#'\"]*)\?[^\s#'\"]*")
_SECRET_KEY = re.compile(r"secret|token|password|passwd|credential|^key$"
                         r"|access_key|private", re.IGNORECASE)


def redact(text: str) -> str:
  """``text`` without URL credentials or query strings."""
  return _QUERY.sub(r"\1?***", _USERINFO.sub("***@", text))


def _hide(d: dict) -> dict:
  return {k: ("***" if _SECRET_KEY.search(str(k)) else
              _hide(v) if isinstance(v, dict) else v) for k, v in d.items()}


def _redact_options(value: str) -> str:
  """storage options (JSON) with the values of secret-looking keys hidden."""
  try:
    options = json.loads(value)
  except ValueError:
    return "***" if value else value
  if not isinstance(options, dict):
    return "***"
  return json.dumps(_hide(options), sort_keys=True)


def config_as_json(config) -> dict:
  """The config as plain JSON values (tuples become lists), secrets
  redacted (``redact``)."""
  def clean(v, key=""):
    if key == "storage_options" and isinstance(v, dict):
      return _hide(v)
    if isinstance(v, dict):
      return {k: clean(x, k) for k, x in v.items()}
    if isinstance(v, list):
      return [clean(x) for x in v]
    if isinstance(v, str):
      return _redact_options(v) if key == "storage_options" else redact(v)
    return v
  return clean(json.loads(json.dumps(config.to_dict(), default=str)))


def config_changes(recorded: dict, current: dict):
  """(blocking, noted) keys whose values differ, each as "key (old -> new)".
  A key only one side has (one added to or removed from the trainer since
  the workdir was made; its default keeps the old behaviour) is noted."""
  old, new = flatten(recorded), flatten(current)
  blocking, noted = [], []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key), new.get(key)
    if a == b or _matches(key, _FREE):
      continue
    one_sided = key not in old or key not in new
    (noted if one_sided or _matches(key, _NOTED) else blocking).append(
        f"{key} ({a!r} -> {b!r})")
  return blocking, noted


def check_resume(workdir: str, config, log=print, *,
                 finished: bool = False) -> None:
  """One-line ValueError when ``workdir`` was made by a config that differs
  from ``config`` in keys that change the train state or the data stream
  (unless config.resume_despite_changes); one note line for keys that only
  change the numbers from here on. Nothing without a config.json.

  ``finished``: the workdir's run is done (a rerun trains nothing and
  evaluates nothing new): the changed keys that would only be noted are
  not used, and said to be so in one line instead (a key that changes the
  train state or the data stream is refused all the same: another run's
  config in this workdir)."""
  path = os.path.join(workdir, CONFIG_FILE)
  try:
    with open(path) as f:
      recorded = json.load(f)
  except (OSError, ValueError):
    return
  blocking, noted = config_changes(recorded, config_as_json(config))
  changed = blocking + noted
  if blocking and not config.get("resume_despite_changes", False):
    raise ValueError(
        f"workdir {workdir} holds a run whose config ({path}) differs in "
        f"keys that change the train state or the data stream: "
        f"{', '.join(blocking)}; use a new --workdir, or resume anyway with "
        "--config.resume_despite_changes=True")
  if changed and log is not None:
    log(f"[lit] config keys changed since the run in {workdir} are not "
        f"used (nothing trains): {', '.join(changed)}" if finished else
        f"[lit] resuming {workdir} with changed config keys: "
        f"{', '.join(changed)}")


def command_line(argv) -> str:
  """``argv`` as a shell line; ``python -m train.main`` for the trainer."""
  argv = list(argv)
  if argv and argv[0].endswith(os.path.join("train", "main.py")):
    argv = [sys.executable, "-m", "train.main"] + argv[1:]
  argv = [a if not a.startswith("--config.data.storage_options=") else
          "--config.data.storage_options=" + _redact_options(
              a.split("=", 1)[1]) for a in argv]
  return redact(shlex.join(argv))


def record_run(workdir: str, config, command: str | None, *,
               config_too: bool = True) -> None:
  """Writes config.json (atomically; not with ``config_too`` False: a rerun
  that trains nothing) and appends the command line."""
  path = os.path.join(workdir, CONFIG_FILE)
  if config_too:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(config_as_json(config), f, indent=1, sort_keys=True)
      f.write("\n")
    os.replace(tmp, path)
  stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
  with open(os.path.join(workdir, COMMAND_FILE), "a") as f:
    f.write(f"# {stamp}\n{command or '(in-process train.train_and_evaluate)'}"
            "\n")


class _Tee:
  """A text stream that also writes to the run log (``err``: it is
  stderr)."""

  def __init__(self, stream, log: "RunLog", err: bool = False):
    self._stream = stream
    self._log = log
    self._err = err

  def write(self, s):
    n = self._stream.write(s)
    self._log.write(s, err=self._err)
    return n

  def flush(self):
    self._stream.flush()
    self._log.flush()

  def __getattr__(self, name):
    return getattr(self._stream, name)


# Set while a run log is attached (train/data/sources/remote.py: a data worker
# process appends its retry lines to the file this names).
LOG_ENV = "INFCL_RUN_LOG"


class RunLog:
  """train.log: what the run prints, from ``capture`` on (buffered until
  ``attach`` names the workdir, which exists only once the config is
  valid): sys.stdout and sys.stderr, absl's log lines (warnings: the bad
  examples' ``shard:key: reason`` lines) and, with several processes, the
  other processes' stderr (their warnings and errors), each line prefixed
  with ``[process P]``. Lines are appended whole (O_APPEND), so that the
  processes' lines do not cut into each other. Progress-bar redraws
  (carriage returns) keep their last state only."""

  active: "RunLog | None" = None

  def __init__(self):
    self._buffer: list[tuple[str, bool]] = []
    self._fd = None
    self._partial = {False: "", True: ""}
    self._saved = None
    self._absl_stream = None
    self._dropped = False
    self._prefix = ""
    self._err_only = False
    self._lock = threading.Lock()

  @classmethod
  def capture(cls) -> "RunLog":
    log = cls()
    log._saved = (sys.stdout, sys.stderr)
    sys.stdout = _Tee(sys.stdout, log)
    sys.stderr = _Tee(sys.stderr, log, err=True)
    # absl's handler keeps the stderr of its creation: its lines (warnings)
    # go through the copy too.
    handler = _absl_python_handler()
    if handler is not None:
      log._absl_stream = handler.stream
      handler.stream = sys.stderr
    cls.active = log
    return log

  def attach(self, workdir: str, keep: bool = True,
             process_index: int = 0) -> None:
    """From now on into ``workdir``/train.log (appended), the text so far
    first. ``process_index`` P > 0: only its stderr, each line prefixed
    ``[process P]``; ``keep=False``: nothing is kept."""
    if self._fd is not None or self._dropped:
      return
    if not keep:
      self._dropped = True
      self._buffer.clear()
      return
    path = os.path.join(workdir, LOG_FILE)
    self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if process_index:
      self._prefix, self._err_only = f"[process {process_index}] ", True
    else:
      stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
      self._append(f"# run started {stamp}\n")
      os.environ[LOG_ENV], os.environ[LOG_ENV + "_PID"] = path, str(
          os.getpid())
    buffered, self._buffer = self._buffer, []
    for text, err in buffered:
      self.write(text, err=err)
    self.flush()

  def _append(self, text: str) -> None:
    data = text.encode("utf-8", "replace")
    while data:
      n = os.write(self._fd, data)
      data = data[n:]

  def write(self, s: str, err: bool = False) -> None:
    if self._dropped or not s:
      return
    with self._lock:
      if self._fd is None:
        self._buffer.append((s, err))
        return
      if self._err_only and not err:
        return
      if (self._partial[err].startswith("\r") and s[0] not in "\r\n"):
        # Text after a progress bar's redraw: a line of its own.
        self._partial[err] += "\n"
      *lines, self._partial[err] = (self._partial[err] + s).split("\n")
      out = []
      for line in lines:
        # A redrawn line: its last non-empty state.
        parts = [p for p in line.split("\r") if p.strip()]
        out.append(self._prefix + (parts[-1] if parts else "") + "\n")
      if out:
        self._append("".join(out))

  def log_only(self, text: str) -> None:
    """``text`` into train.log only (not on the console)."""
    if self._fd is not None:
      self.write(text if text.endswith("\n") else text + "\n",
                 err=self._err_only)

  def flush(self) -> None:
    pass  # Every whole line is written at once.

  def close(self) -> None:
    if self._saved is not None:
      handler = _absl_python_handler()
      if handler is not None and self._absl_stream is not None:
        handler.stream = self._absl_stream
      sys.stdout, sys.stderr = self._saved
      self._saved = None
    if self._fd is not None:
      for err in (False, True):
        if self._partial[err].strip():
          self.write("\n", err=err)
      os.close(self._fd)
      self._fd = None
      if os.environ.get(LOG_ENV + "_PID") == str(os.getpid()):
        os.environ.pop(LOG_ENV, None)
        os.environ.pop(LOG_ENV + "_PID", None)
    if RunLog.active is self:
      RunLog.active = None


def _absl_python_handler():
  """absl's Python log handler, if absl logging is in use."""
  try:
    return absl_logging.get_absl_handler().python_handler
  except AttributeError:
    return None
