"""Encoding batches of documents into token ids, in this process or in ``--workers N`` processes.

A document becomes ``[bos_id] + ids + [eos_id]``: the BOS only when the tokenizer's
``add_bos`` says so (Llama 3, Mistral/Mixtral; not Qwen, byte or bpe), the EOS whenever the
tokenizer has one (byte has none). Ids inside a document are encoded with
``add_special_tokens=False`` (see :mod:`llmtrain.engine.data.tokenizer`).

Design decisions:

- **Byte-identical output for any N.** Batches are cut by the reader in the main process
  (independent of N), each worker encodes whole batches, and results are consumed strictly in
  submission order; encoding is a pure function of (tokenizer, text). So ``tokens.bin`` and
  ``index.npy`` do not depend on N (tested).
- **Bounded memory.** At most ``2 * N`` batches are in flight (a plain ``Pool.imap`` would
  pull the whole input iterator into its task queue as fast as it can read it).
- **spawn, not fork.** The main process may already run tokenizers' Rust thread pool and a
  progress-bar thread; forking those is how deadlocks happen. A spawned worker gets the
  tokenizer pickled (its JSON pipeline and config) once, in the pool initializer.
- **A dead worker is an error, never a hang**: ``concurrent.futures.ProcessPoolExecutor``
  (unlike ``multiprocessing.Pool``, which silently respawns a worker that died and waits
  forever) reports ``BrokenProcessPool``, turned into a one-line error suggesting
  ``--workers 1``. Spawned workers re-import the main module, so a caller script must be a
  file (or ``-c``) with the usual ``if __name__ == "__main__":`` guard; the CLI is.
- **One Rust thread per worker.** ``encode_batch`` is already multi-threaded inside one
  process (``TOKENIZERS_PARALLELISM``); with N worker processes each is kept single-threaded
  so N workers use about N cores instead of N x cores threads.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Iterable, Iterator

import numpy as np

from llmtrain.engine.data.tokenizer import ByteTokenizer
from llmtrain.errors import LLMTrainError

_WORKER_TOK = None


def encode_docs(tok, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, list[int]]:
    """Encode a batch: the concatenated ids (BOS/EOS per document) and each document's length."""
    eos = tok.eos_id
    if isinstance(tok, ByteTokenizer):
        arrays = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    else:
        arrays = [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(texts)]
    head = np.array([tok.bos_id], dtype=np.int64) if tok.add_bos else None
    tail = np.array([eos], dtype=np.int64) if eos is not None else None
    if head is not None or tail is not None:
        arrays = [np.concatenate([p for p in (head, a, tail) if p is not None]) for a in arrays]
    lengths = [len(a) for a in arrays]
    flat = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)
    return flat, lengths


def _init_worker(tok) -> None:
    global _WORKER_TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOK = tok


def _work(texts: list[str], dtype_name: str) -> tuple[bytes, list[int]]:
    flat, lengths = encode_docs(_WORKER_TOK, texts, np.dtype(dtype_name))
    return flat.tobytes(), lengths


def encode_stream(tok, batches: Iterable[list[str]], dtype: np.dtype, workers: int = 1) -> Iterator[tuple[bytes, list[int]]]:
    """``(token bytes, document lengths)`` per batch, in input order, with ``workers`` processes."""
    if workers <= 1:
        for texts in batches:
            flat, lengths = encode_docs(tok, texts, dtype)
            yield flat.tobytes(), lengths
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    ctx = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(tok,)) as pool:
            pending: deque = deque()
            for texts in batches:
                pending.append(pool.submit(_work, list(texts), dtype.name))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    except BrokenProcessPool as exc:
        raise LLMTrainError(f"an encoding worker process died ({exc})",
                            "run with --workers 1, or from a script file guarded by if __name__ == '__main__'",
                            path="--workers") from None
