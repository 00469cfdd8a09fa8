"""Every config key that names a file takes a URL, read through the remote
layer (train/data/sources/remote.py; here the local S3 server), or refuses
one in a line that names the key (train/file_keys.py)."""
import os

import pytest

from tests import helpers
from tests import lit_fixtures
from tests.netservers import moto_endpoint  # noqa: F401  (fixture)
from tests.netservers import s3  # noqa: F401  (fixture)
from train import file_keys
from train.data.sources import remote

pytest.importorskip("s3fs", reason="the cloud extra")
pytest.importorskip("moto", reason="the dev extra")

TOKENIZER = os.path.join(lit_fixtures.ROOT, "tests", "fixtures", "towers",
                         "clip_bpe_json")


def _tiny(tmp_path, **overrides):
  import sys  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, lit_fixtures.ROOT)
  from configs import lit_demo  # pylint: disable=import-outside-toplevel
  return helpers.set_overrides(lit_demo.get_config("tiny"), {
      "data.data_dir": str(tmp_path / "tfds"), **overrides})


def test_file_keys_take_urls_or_refuse_them_in_one_line(s3, tmp_path,
                                                        monkeypatch):
  from train import train as train_lib  # pylint: disable=import-outside-toplevel
  cache = tmp_path / "cache"
  monkeypatch.setattr(remote, "default_files_cache", lambda: str(cache))
  names = "".join(f"shape {i}\n" for i in range(8)).encode()
  s3.put("cfg/names.txt", names)
  s3.put("cfg/templates.txt", b"a photo of a {}.\na drawing of a {}.\n")
  s3.put_dir(TOKENIZER, "cfg/tokenizer")  # A directory of files.
  config = _tiny(tmp_path, **{
      "data.zeroshot_classnames_file": s3.url("cfg/names.txt"),
      "data.zeroshot_templates_file": s3.url("cfg/templates.txt"),
      "tokenizer.kind": "clip_bpe",
      "tokenizer.bpe_path": s3.url("cfg/tokenizer")})
  run = train_lib.validate(config)  # The config check passes with URLs.
  # The run's config names the local copies; the given one, the URLs.
  assert config.data.zeroshot_classnames_file == s3.url("cfg/names.txt")
  local = run.data.zeroshot_classnames_file
  assert local.startswith(str(cache)) and open(local, "rb").read() == names
  with open(os.path.join(run.tokenizer.bpe_path, "tokenizer.json"),
            "rb") as f, open(os.path.join(TOKENIZER, "tokenizer.json"),
                             "rb") as g:
    assert f.read() == g.read()
  # Fetched once: the same versions are read from the cache.
  mtime = os.stat(local).st_mtime_ns
  assert file_keys.localized(config).data.zeroshot_classnames_file == local
  assert os.stat(local).st_mtime_ns == mtime

  # A URL that is not there: one line naming the key.
  config = _tiny(tmp_path, **{
      "data.zeroshot_templates_file": s3.url("cfg/nope.txt")})
  with pytest.raises(FileNotFoundError) as e:
    train_lib.validate(config)
  assert str(e.value) == (f"config.data.zeroshot_templates_file: "
                          f"{s3.url('cfg/nope.txt')} does not exist")

  # Keys that take no URL say so, in one line naming the key.
  for key in file_keys.LOCAL_ONLY:
    with pytest.raises(ValueError) as e:
      train_lib.validate(_tiny(tmp_path, **{key: s3.url("x/y.npz")}))
    assert str(e.value).startswith(
        f"config.{key}={s3.url('x/y.npz')}: URLs are not taken here (")
    assert "\n" not in str(e.value)
