"""Zero-shot class names and prompt templates: data, never code.

Where they come from, first match wins:

* class names: ``config.data.zeroshot_classnames`` (a list), else
  ``zeroshot_classnames_file``, else the dataset's own ``ClassLabel`` names;
  label names that are WordNet IDs (``n01440764``: ``imagenet2012`` and its
  variants in TFDS) are replaced by human names from
  ``train/eval/data/imagenet_clip_classnames.tsv``;
* templates: ``config.data.zeroshot_templates`` (a list), else
  ``zeroshot_templates_file``, else the dataset's default: CLIP's 80 ImageNet
  prompts (``train/eval/data/imagenet_clip_templates.txt``) for a WordNet-ID
  label set, synthetic_shapes' own held-out prompts, and otherwise CLIP's
  single base prompt ``"a photo of a {}."``.

A source with plain integer labels (webdataset ``.json``, a table column)
has no label names: its class names must come from the config (name i for
label i; ``resolve_integer_labels``).

docs/evaluation.md ("Zero-shot class names and prompts") gives each shipped file's source.

File formats (UTF-8, one entry per line, blank lines and lines starting with
"#" ignored): a class-name file has either one name per line in label order,
or ``label<TAB>name`` lines that map the dataset's label names (WordNet IDs,
say) to class names; a template file has one prompt per line with ``{}``
where the class name goes.
"""
from __future__ import annotations

import dataclasses
import os
import re

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
IMAGENET_CLASSNAMES = os.path.join(DATA_DIR, "imagenet_clip_classnames.tsv")
IMAGENET_TEMPLATES = os.path.join(DATA_DIR, "imagenet_clip_templates.txt")
# CLIP's base prompt (Radford et al. 2021, section 3.1.4).
BASE_TEMPLATES = ("a photo of a {}.",)

_WNID = re.compile(r"^n\d{8}$")


@dataclasses.dataclass(frozen=True)
class Prompts:
  """Class names and templates, and where each came from (for the log)."""
  classnames: tuple[str, ...]
  templates: tuple[str, ...]
  classnames_from: str
  templates_from: str


def resolve_path(path: str, what: str) -> str:
  """``path`` as given (``~`` expanded), else a file shipped in DATA_DIR."""
  full = os.path.expanduser(path)
  if os.path.isfile(full):
    return full
  shipped = os.path.join(DATA_DIR, path)
  if os.path.isfile(shipped):
    return shipped
  raise ValueError(f"{what}: file not found: {path!r} (nor shipped in "
                   f"{DATA_DIR}: {sorted(os.listdir(DATA_DIR))})")


def _lines(path: str, what: str) -> list[str]:
  try:
    with open(path, encoding="utf-8") as f:
      raw = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"{what}: cannot read {path!r}: {e}") from None
  return [l.rstrip("\r") for l in raw
          if l.strip() and not l.lstrip().startswith("#")]


def read_classnames(path: str, what: str = "class-name file"):
  """(names in order, {label: name} or None) of a class-name file."""
  lines = _lines(path, what)
  if not lines:
    raise ValueError(f"{what} {path!r} has no class names")
  tabbed = ["\t" in l for l in lines]
  if any(tabbed) and not all(tabbed):
    bad = tabbed.index(False) if tabbed[0] else tabbed.index(True)
    raise ValueError(f"{what} {path!r}: line {bad + 1} mixes the 'name' and "
                     "'label<TAB>name' formats")
  if not all(tabbed):
    return tuple(l.strip() for l in lines), None
  mapping = {}
  for i, l in enumerate(lines):
    key, _, name = l.partition("\t")
    key, name = key.strip(), name.strip()
    if not key or not name:
      raise ValueError(f"{what} {path!r}: line {i + 1} {l!r} is not "
                       "'label<TAB>name'")
    if key in mapping:
      raise ValueError(f"{what} {path!r}: label {key!r} appears twice")
    mapping[key] = name
  return tuple(mapping.values()), mapping


def read_templates(path: str, what: str = "template file") -> tuple[str, ...]:
  lines = [l.strip() for l in _lines(path, what)]
  if not lines:
    raise ValueError(f"{what} {path!r} has no templates")
  check_templates(lines, f"{what} {path!r}")
  return tuple(lines)


def check_templates(templates, what: str) -> None:
  for t in templates:
    if t.count("{}") != 1 or re.search(r"\{(?!\})|(?<!\{)\}", t):
      raise ValueError(f"{what}: template {t!r} must contain '{{}}' exactly "
                       "once (where the class name goes) and no other braces")


def is_wordnet(label_names) -> bool:
  return bool(label_names) and all(_WNID.match(str(n)) for n in label_names)


def _map_labels(label_names, mapping, where: str) -> tuple[str, ...]:
  missing = [n for n in label_names if n not in mapping]
  if missing:
    raise ValueError(f"{where} has no name for {len(missing)} of the "
                     f"dataset's labels (e.g. {missing[:3]})")
  return tuple(mapping[n] for n in label_names)


def has_classnames(data) -> bool:
  return bool(data.zeroshot_classnames or data.zeroshot_classnames_file)


def resolve_integer_labels(data) -> Prompts:
  """The class names and templates of a source whose labels are plain
  integers (a webdataset .json field, a table column): the names come from
  the config alone, name i for label i. A ``label<TAB>name`` file keys them
  by the integer labels 0..n-1 (in any order)."""
  if data.zeroshot_classnames:
    names, names_from = tuple(data.zeroshot_classnames), "config list"
  else:
    where = "config.data.zeroshot_classnames_file"
    path = resolve_path(data.zeroshot_classnames_file, where)
    names, mapping = read_classnames(path, where)
    names_from = path
    if mapping is not None:
      try:
        by_label = {int(k): v for k, v in mapping.items()}
      except ValueError:
        raise ValueError(f"{where} {path!r}: the labels of 'label<TAB>name' "
                         "lines must be integers for a source with integer "
                         f"labels, got e.g. {next(iter(mapping))!r}") from None
      if sorted(by_label) != list(range(len(by_label))):
        raise ValueError(f"{where} {path!r}: the labels of its 'label<TAB>"
                         f"name' lines must be 0..{len(by_label) - 1}, each "
                         "once")
      names = tuple(by_label[i] for i in range(len(by_label)))
  return resolve(data, names, classnames=(names, names_from))


def resolve(data, label_names, *, dataset_templates=None,
            classnames=None) -> Prompts:
  """The class names and templates of ``config.data`` (module docstring).

  Args:
    data: ``config.data`` (its ``zeroshot_*`` keys).
    label_names: the dataset's ``ClassLabel`` names, in label order.
    dataset_templates: the dataset's own default templates, if it has any.
  """
  n = len(label_names)
  if classnames is not None:  # Resolved by the caller (integer labels).
    names, names_from = classnames
  elif data.zeroshot_classnames:
    names, names_from = tuple(data.zeroshot_classnames), "config list"
  elif data.zeroshot_classnames_file:
    path = resolve_path(data.zeroshot_classnames_file,
                        "config.data.zeroshot_classnames_file")
    names, mapping = read_classnames(path, "config.data.zeroshot_classnames_file")
    if mapping is not None:
      names = _map_labels(label_names, mapping, path)
    names_from = path
  elif is_wordnet(label_names):
    _, mapping = read_classnames(IMAGENET_CLASSNAMES)
    names = _map_labels(label_names, mapping, IMAGENET_CLASSNAMES)
    names_from = IMAGENET_CLASSNAMES
  else:
    names = tuple(str(c).replace("_", " ") for c in label_names)
    names_from = "dataset labels"
  if len(names) != n:
    raise ValueError(f"zero-shot class names from {names_from}: {len(names)} "
                     f"names for the dataset's {n} classes")

  if data.zeroshot_templates:
    templates, templates_from = tuple(data.zeroshot_templates), "config list"
    check_templates(templates, "config.data.zeroshot_templates")
  elif data.zeroshot_templates_file:
    path = resolve_path(data.zeroshot_templates_file,
                        "config.data.zeroshot_templates_file")
    templates = read_templates(path, "config.data.zeroshot_templates_file")
    templates_from = path
  elif dataset_templates:
    templates, templates_from = tuple(dataset_templates), "dataset default"
  elif is_wordnet(label_names):
    templates = read_templates(IMAGENET_TEMPLATES)
    templates_from = IMAGENET_TEMPLATES
  else:
    templates, templates_from = BASE_TEMPLATES, "CLIP base prompt"
  return Prompts(classnames=names, templates=templates,
                 classnames_from=names_from, templates_from=templates_from)
