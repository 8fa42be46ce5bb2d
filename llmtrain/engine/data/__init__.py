"""The data pipeline: tokenizers, ``data prepare``, synthetic and memmap datasets, the DP sampler.

Public API::

    load_tokenizer(spec, train_texts=None) -> Tokenizer      # byte | PATH/tokenizer.json | DIR | bpe:VOCAB
    prepare(inputs, out_dir, tokenizer_spec, progress=True) -> dict   # tokens.bin, index.npy, meta.json
    MarkovChain(vocab_size, seq_len, seed, k=4, alpha=1.0)   # .sample(i), .entropy_rate(), length None
    MemmapDataset(path, seq_len)                             # .sample(i), len(), .length
    BatchSampler(dataset_len, global_batch, micro_batch, dp_rank, dp_size, seed, shuffle=True)
    build_data(data_cfg, seq_len, vocab_size, seed) -> dataset
    microbatches(dataset, sampler) -> [(inputs, labels)]     # LongTensor[micro, seq_len] each

Nothing here imports torch at import time (only :func:`microbatches` does, when called).
"""

from llmtrain.engine.data.loader import Dataset, build_data, microbatches
from llmtrain.engine.data.memmap import MemmapDataset, read_meta
from llmtrain.engine.data.prepare import prepare
from llmtrain.engine.data.sampler import BatchSampler
from llmtrain.engine.data.synthetic import MarkovChain
from llmtrain.engine.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BatchSampler", "ByteTokenizer", "Dataset", "HFTokenizer", "MarkovChain", "MemmapDataset", "Tokenizer",
    "build_data", "load_tokenizer", "microbatches", "prepare", "read_meta", "train_bpe",
]
