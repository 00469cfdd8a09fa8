"""Data for the LiT trainer: sources (TFDS, webdataset shards, CSV/TSV/JSONL
tables, precomputed embeddings), the synthetic_shapes dataset, the grain
input pipeline of uint8 micro-batches, tokenizers and held-out evaluation
sets.

The trainer imports everything it needs of the data from here:
default_data_config, default_tokenizer_config, check_data_config,
make_tokenizer, make_train_iterator, make_eval_sets, open_source,
host_size.
"""

from train.data.config import check_data_config
from train.data.config import default_data_config
from train.data.config import default_tokenizer_config
from train.data.eval_sets import eval_sets_of
from train.data.eval_sets import EvalSets
from train.data.eval_sets import make_eval_sets
from train.data.eval_sets import without_labels
from train.data.eval_sets import RetrievalSet
from train.data.eval_sets import ZeroShotSet
from train.data import sources
from train.data.pipeline import host_size
from train.data.pipeline import make_train_iterator
from train.data.pipeline import TrainIterator
from train.data.sources import open_source
from train.data.tokenizer import make_tokenizer
from train.data.tokenizer import Tokenizer
