"""Every pointer in the repository leads somewhere.

Every relative link in README.md and docs/*.md resolves: the file (or
directory) exists, and a `#anchor` names a heading of the target file, by
GitHub's rule for heading ids. Every repository path, module and page
section cited in the pages and in the docstrings and comments of the code,
scripts and tests exists. No tracked file names one machine's directories
or notes outside the repository, and the library cites no file its wheel
lacks except through the project URL. A reader who follows a pointer lands
where it says; a renamed file, module or heading fails here instead."""
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the target ends at whitespace (a title
# may follow) or at the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _prose(text):
  """The text outside fenced blocks and inline code, where links render."""
  return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading):
  """GitHub's id of a heading: its rendered text, lower-cased, every
  character that is not a letter, digit, space, '-' or '_' dropped, spaces
  made '-'."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # link -> text
  text = re.sub(r"<[^>]+>", "", text)                         # inline HTML
  text = text.replace("`", "")
  text = re.sub(r"(\*\*|__|\*|(?<!\w)_(?=\w)|(?<=\w)_(?!\w))", "", text)
  text = text.strip().lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(path):
  """The heading ids of a Markdown file; a repeated heading gets -1, -2, ...
  as on GitHub."""
  seen, ids = {}, set()
  text = _FENCE.sub("", path.read_text(encoding="utf-8"))
  for _, heading in _HEADING.findall(text):
    base = slug(heading)
    n = seen.get(base, 0)
    seen[base] = n + 1
    ids.add(base if n == 0 else f"{base}-{n}")
  return ids


def broken_links(path):
  """Each relative link of `path` that does not resolve, with why."""
  broken = []
  for target in _LINK.findall(_prose(path.read_text(encoding="utf-8"))):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, mailto:, ...
      continue
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.exists():
      broken.append(f"{target}: no such file {dest}")
      continue
    if anchor:
      if dest.is_dir() or dest.suffix.lower() != ".md":
        broken.append(f"{target}: an anchor into a file that is not Markdown")
      elif anchor not in anchors(dest):
        broken.append(f"{target}: {dest.name} has no heading #{anchor}")
  return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
  assert not broken_links(page), "\n".join(broken_links(page))


def test_the_pages_are_found():
  names = {p.name for p in PAGES}
  assert {"README.md", "losses.md", "training.md", "testing.md"} <= names


def test_a_broken_file_or_anchor_is_reported(tmp_path):
  (tmp_path / "other.md").write_text(
      "# Other page\n\n## The `groups=` cost, per backend\n\n## Twice\n\n"
      "## Twice\n\n```\n## not a heading\n```\n")
  page = tmp_path / "page.md"
  page.write_text(
      "# Page\n\n## Here & now\n\n"
      "[ok](other.md) [ok](other.md#the-groups-cost-per-backend) "
      "[ok](other.md#twice-1) [ok](#here--now) ![ok](other.md) "
      "[web](https://example.com/x.md#nowhere) `[code](missing.md)`\n\n"
      "[gone](missing.md) [bad anchor](other.md#no-such-heading) "
      "[fenced](other.md#not-a-heading) [self](#nowhere) [third](other.md#twice-2)\n\n"
      "```\n[in a block](missing-too.md)\n```\n")
  found = broken_links(page)
  assert [b.split(":")[0] for b in found] == [
      "missing.md", "other.md#no-such-heading", "other.md#not-a-heading",
      "#nowhere", "other.md#twice-2"], found


@pytest.mark.parametrize("heading, want", [
    ("LiT with your checkpoint and shards", "lit-with-your-checkpoint-and-shards"),
    ("5. GPU kernels (Pallas, Triton lowering)", "5-gpu-kernels-pallas-triton-lowering"),
    ("Your own data: webdataset shards and CSV/TSV/JSONL tables",
     "your-own-data-webdataset-shards-and-csvtsvjsonl-tables"),
    ("The `groups=` cost **now**", "the-groups-cost-now"),
    ("Float32 fidelity", "float32-fidelity"),
    ("[Linked](x.md) heading_with_underscore", "linked-heading_with_underscore"),
])
def test_slug_follows_github(heading, want):
  assert slug(heading) == want


# Citations across the tree. A fact lives in one place, and every pointer to
# it (a file, a module, a section of a page) must lead somewhere that exists:
# README.md, BENCHMARKS.md and docs/*.md, and the docstrings and comments of
# the code, the scripts and the tests. A renamed file, module or heading
# fails here with the places that still cite the old name.

# The placeholder project URL (pyproject's [project.urls]); the library's
# docstrings cite the repository's other files through it, since the wheel
# holds only infcl_jax/.
PROJECT_URL = "https://github.com/infcl-jax/infcl-jax"
_CODE_DIRS = ("infcl_jax", "train", "benchmarks", "scripts", "tests", "configs")
# The repository's top-level directories, and the package directories that a
# text may name relative to infcl_jax/ or train/ ("kernels/pallas/lse_fwd.py").
_TOP = {"infcl_jax", "train", "benchmarks", "scripts", "tests", "docs",
        "configs", "notebooks", ".ci"}
_PACKAGE_DIRS = {"backends", "kernels", "losses", "data", "eval", "towers"}
# Paths of other projects that share a directory name with ours.
_EXTERNAL = {
    "configs/proj/image_text/lit_coco.py",              # big_vision's
    "notebooks/Prompt_Engineering_for_ImageNet.ipynb",  # OpenAI CLIP's
}
_PATH = re.compile(r"(?<![\w./~$@:<{-])((?:[\w.-]+/)+(?:[\w.-]*\w)?/?)(?![\w{*\[\\])")
_EXT = re.compile(r"\.(py|md|sh|txt|toml|jsonl?|csv|tsv|ipynb|png|npz)$")
_MODULE = re.compile(r"(?<![\w./-])((?:infcl_jax|train)(?:\.\w+)+)(?![\w{])")
_URL = re.compile(re.escape(PROJECT_URL) + r"/(?:blob|tree)/main/([^\s#)>`\"',]*[\w/])"
                  r"(?:#([\w-]+))?")
# A section of a page cited by its heading: `page.md "Heading"`, also with a
# comma, a colon or a parenthesis between, and across a comment's line break.
_SECTION = re.compile(
    r"((?:[\w.-]+/)*[\w.-]+\.md)`?[,:]?\s*\(?(?:\n\s*#)?\s*\"([\w`][^\"\n]*"
    r"(?:\n\s*#?\s*[^\"\n]+)?)\"")
# `BENCHMARKS.md#anchor` outside Markdown links (those are checked above).
_ANCHOR = re.compile(r"(?<![\w/(])((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")


def citing_files(root=ROOT):
  """The files whose text is checked: the pages, and the .py / .sh files of
  the code directories (and CI's entry point)."""
  files = [root / "README.md", root / "BENCHMARKS.md",
           *sorted((root / "docs").glob("*.md"))]
  for d in _CODE_DIRS:
    files += sorted(p for p in (root / d).rglob("*")
                    if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts)
  files += [p for p in [root / ".ci" / "run"] if p.exists()]
  # This file's own examples of broken citations are meant to be broken.
  return [f for f in files if f.exists() and f.name != "test_docs.py"]


def _line(text, pos):
  return text.count("\n", 0, pos) + 1


def _path_exists(path, root=ROOT):
  bases = [root, root / "infcl_jax", root / "train"]
  return any((b / path).exists() or (b / f"{path}.py").exists() for b in bases)


def _module_exists(dotted, root=ROOT):
  """infcl_jax.a.b.Name: a.py or a/b.py exists, or a package's __init__
  names what follows it."""
  parts = dotted.split(".")
  path = root / parts[0]
  for part in parts[1:]:
    if part.startswith("__"):
      return True
    if (path / part).is_dir():
      path = path / part
    elif (path / f"{part}.py").is_file():
      return True
    else:
      init = path / "__init__.py"
      return init.is_file() and re.search(rf"\b{part}\b", init.read_text(
          encoding="utf-8")) is not None
  return True


def headings(path):
  """The heading texts of a Markdown file, as rendered (no `#`, code marks
  or emphasis)."""
  text = _FENCE.sub("", path.read_text(encoding="utf-8"))
  out = set()
  for _, heading in _HEADING.findall(text):
    h = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    out.add(re.sub(r"(\*\*|__)", "", h).strip())
  return out


def broken_citations(path, root=ROOT):
  """Each citation in `path` of a repository file, module or page section
  that does not exist: 'file:line: what'."""
  text = path.read_text(encoding="utf-8")
  rel = path.relative_to(root)
  is_page = path.suffix == ".md"
  broken = []

  urls = [m.span() for m in re.finditer(r"https?://[^\s)>\"'`]+", text)]

  def bad(pos, what):
    broken.append(f"{rel}:{_line(text, pos)}: {what}")

  def in_url(pos):
    return any(a <= pos < b for a, b in urls)

  for m in _PATH.finditer(text):
    p = m.group(1).rstrip(".")
    first = p.split("/")[0]
    if p in _EXTERNAL or in_url(m.start()):
      continue
    if first in _TOP or (first in _PACKAGE_DIRS and (_EXT.search(p) or p.endswith("/"))):
      if not _path_exists(p, root):
        bad(m.start(), f"no file or directory {p}")
  for m in _MODULE.finditer(text):
    dotted = m.group(1)
    # In code, `train` is also a common variable name; pages mean the package.
    if dotted.startswith("train.") and not is_page:
      continue
    last = dotted.rsplit(".", 1)[1]
    if last in ("log", "json", "jsonl", "txt", "py", "csv") or last.endswith("_"):
      continue   # a file name, or a prefix ("infcl_jax.kernels.lse_")
    if not _module_exists(dotted, root):
      bad(m.start(), f"no module or name {dotted}")
  targets = [(m.start(), m.group(1), m.group(2)) for m in _URL.finditer(text)]
  for pos, target, anchor in targets:
    if not (root / target).exists():
      bad(pos, f"{PROJECT_URL}: no file {target}")
    elif anchor and anchor not in anchors(root / target):
      bad(pos, f"{PROJECT_URL}: {target} has no heading #{anchor}")
  # Code in a page is not a citation; blanked to its length, so that the
  # line numbers stay right.
  prose = text
  if is_page:
    for rx in (_FENCE, _INLINE_CODE):
      prose = rx.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
  for m in _SECTION.finditer(prose):
    if in_url(m.start()) and not is_page:
      continue
    page, section = m.group(1), " ".join(re.sub(r"\n\s*#?", " ", m.group(2)).split())
    dest = (path.parent / page) if (path.parent / page).exists() else root / page
    if page.startswith("http") or not dest.exists():
      if dest.name in ("README.md", "BENCHMARKS.md") or page.startswith("docs/"):
        bad(m.start(), f"no page {page}")
      continue
    if section not in headings(dest):
      bad(m.start(), f'{page} has no section "{section}"')
  if not is_page:
    for m in _ANCHOR.finditer(text):
      page, anchor = m.group(1), m.group(2)
      if in_url(m.start()):
        continue
      dest = root / page
      if not dest.exists():
        if dest.name in ("README.md", "BENCHMARKS.md") or page.startswith("docs/"):
          bad(m.start(), f"no page {page}")
      elif anchor not in anchors(dest):
        bad(m.start(), f"{page} has no heading #{anchor}")
  return broken


def test_every_cited_path_module_and_section_exists():
  broken = [b for f in citing_files() for b in broken_citations(f)]
  assert not broken, "\n".join(broken)


def test_the_citing_files_are_found():
  rel = {str(f.relative_to(ROOT)) for f in citing_files()}
  assert {"README.md", "BENCHMARKS.md", "docs/losses.md", "infcl_jax/api.py",
          "train/main.py", "benchmarks/harness.py", "scripts/gpu.sh",
          "tests/test_layout.py"} <= rel


def test_a_broken_citation_is_reported(tmp_path):
  (tmp_path / "infcl_jax" / "kernels").mkdir(parents=True)
  (tmp_path / "infcl_jax" / "__init__.py").write_text("from x import loss\n")
  (tmp_path / "infcl_jax" / "kernels" / "lse_fwd.py").write_text("")
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "math.md").write_text("# Math\n\n## The `merge`\n")
  (tmp_path / "BENCHMARKS.md").write_text("# B\n\n## Ring\n")
  (tmp_path / "infcl_jax" / "mod.py").write_text(
      '"""Fine: infcl_jax/kernels/lse_fwd.py, kernels/lse_fwd.py, '
      "infcl_jax.kernels.lse_fwd.lse_fwd, infcl_jax.loss, docs/math.md\n"
      '("The merge"), BENCHMARKS.md "Ring", BENCHMARKS.md#ring,\n'
      f"{PROJECT_URL}/blob/main/docs/math.md#the-merge, f'tests/test_{{x}}.py',\n"
      "configs/proj/image_text/lit_coco.py, /data/train/x.py, foo/bar.py.\n"
      "Broken: kernels/lse_bwd.py, infcl_jax.kernels.gone, infcl_jax.nothing,\n"
      'BENCHMARKS.md "Multi-device", BENCHMARKS.md#gone, (BENCHMARKS.md\n'
      '# "Mosaic GPU backend"), docs/math.md, "The Merge",\n'
      f"{PROJECT_URL}/blob/main/docs/gone.md, {PROJECT_URL}/blob/main/docs/math.md#x\n"
      '"""\n')
  found = broken_citations(tmp_path / "infcl_jax" / "mod.py", tmp_path)
  assert [f.split(": ", 1)[1] for f in found] == [
      "no file or directory kernels/lse_bwd.py",
      "no module or name infcl_jax.kernels.gone",
      "no module or name infcl_jax.nothing",
      f"{PROJECT_URL}: no file docs/gone.md",
      f"{PROJECT_URL}: docs/math.md has no heading #x",
      'BENCHMARKS.md has no section "Multi-device"',
      'BENCHMARKS.md has no section "Mosaic GPU backend"',
      'docs/math.md has no section "The Merge"',
      "BENCHMARKS.md has no heading #gone"], found


def _tracked_text_files():
  try:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  for name in filter(None, names):
    path = ROOT / name
    if path.is_file() and path.suffix not in (".png", ".npz", ".safetensors"):
      try:
        yield name, path.read_text(encoding="utf-8")
      except UnicodeDecodeError:
        continue


# Built from parts, so that this file does not match itself.
_MACHINE_PATH = re.compile("/(?:" + "work|root|home" + r")/[\w.-]")
_OUTSIDE_NOTES = re.compile(r"(?<![\w/.-])(?:\.\./)?" + "shared" + r"/|\.\./" + "shared")


def test_no_machine_paths_and_no_notes_outside_the_repository():
  """Tracked files name no directory of one machine (/work/, /root/,
  /home/) and cite nothing outside the repository (notes kept in a folder
  beside the checkout): what a reader is sent to is in the checkout."""
  found = [f"{name}:{_line(text, m.start())}: {m.group(0)!r}"
           for name, text in _tracked_text_files()
           for rx in (_MACHINE_PATH, _OUTSIDE_NOTES)
           for m in rx.finditer(text)]
  assert not found, "\n".join(found)


# What a library docstring or comment may not send a pip user to: the
# repository's other files, which the wheel does not ship (the project URL
# is the way to cite them).
_OUTSIDE_THE_WHEEL = re.compile(
    r"(?<![\w/.-])(?:(?:docs|tests|benchmarks|scripts|configs|train)/[\w.]"
    r"|(?:BENCHMARKS|README)\.md)")


def test_the_library_cites_no_file_the_wheel_lacks():
  found = []
  for path in sorted((ROOT / "infcl_jax").rglob("*.py")):
    text = path.read_text(encoding="utf-8")
    for m in _OUTSIDE_THE_WHEEL.finditer(text):
      if text[:m.start()].endswith("/blob/main/"):
        continue
      found.append(f"{path.relative_to(ROOT)}:{_line(text, m.start())}: "
                   f"{text[m.start():m.start() + 30]!r}")
  assert not found, ("cite through " + PROJECT_URL + "/blob/main/...:\n"
                     + "\n".join(found))


def test_the_long_description_links_only_absolute_urls():
  """pyproject's readme (the page an index shows, away from the checkout)
  is Markdown whose links and images are absolute URLs or none; the wheel
  smoke leg checks the built metadata the same way."""
  import tomllib  # pylint: disable=import-outside-toplevel
  readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
  assert readme["content-type"] == "text/markdown", readme
  text = (ROOT / readme["file"]).read_text(encoding="utf-8")
  targets = _LINK.findall(text) + re.findall(r"<img\b[^>]*\bsrc=[\"']([^\"']+)", text)
  relative = [t for t in targets if not re.match(r"https?://", t)]
  assert not relative, relative
  assert len(text.splitlines()) <= 100
