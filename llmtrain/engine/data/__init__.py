"""The data pipeline: tokenizers, ``data prepare``, synthetic and memmap datasets, the DP sampler.

Public API::

    load_tokenizer(spec, train_texts=None) -> Tokenizer      # byte | PATH/tokenizer.json | DIR | bpe:VOCAB
    prepare(inputs, out_dir, tokenizer_spec, progress=True) -> dict   # tokens.bin, index.npy, meta.json
    MarkovChain(vocab_size, seq_len, seed, k=4, alpha=1.0)   # .sample(i), .entropy_rate(), length None
    MemmapDataset(path, seq_len)                             # .sample(i), len(), .length
    BatchSampler(dataset_len, global_batch, micro_batch, dp_rank, dp_size, seed, shuffle=True)
    build_data(data_cfg, seq_len, vocab_size, seed) -> dataset   # synthetic, memmap, chat, instruction, text
    microbatches(dataset, sampler) -> [(inputs, labels)]     # LongTensor[micro, seq_len] each
                                   # fine-tuning: labels -100 = no loss; packed: + (positions, segments)
    step_target_count(dataset, sampler) -> int | None        # loss targets of the whole global step
    check_finetune_data(recipe) -> DataSummary | None        # build the fine-tuning data once (launch preflight)

Nothing here imports torch at import time (only :func:`microbatches` does, when called).
"""

from llmtrain.engine.data.loader import Dataset, build_data, microbatches, step_target_count
from llmtrain.engine.data.memmap import MemmapDataset, read_meta
from llmtrain.engine.data.prepare import prepare
from llmtrain.engine.data.sampler import BatchSampler
from llmtrain.engine.data.sft import DataSummary, SFTDataset, check_finetune_data
from llmtrain.engine.data.synthetic import MarkovChain
from llmtrain.engine.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BatchSampler", "ByteTokenizer", "DataSummary", "Dataset", "HFTokenizer", "MarkovChain", "MemmapDataset", "SFTDataset",
    "Tokenizer", "build_data", "check_finetune_data", "load_tokenizer", "microbatches", "prepare", "read_meta",
    "step_target_count", "train_bpe",
]
