"""Every relative link in README.md and docs/*.md resolves: the file (or
directory) exists, and a `#anchor` names a heading of the target file, by
GitHub's rule for heading ids. A reader who follows a link lands where it
says; a renamed heading or a moved page fails here instead."""
import pathlib
import re

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
