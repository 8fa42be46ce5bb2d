"""Fine-tuning data: packing (first-fit decreasing, whole samples per row) and step target counts.

Split from tests/test_sft_data.py (which keeps templates, masks and sources). Exact integer
comparisons only, no tolerance: packing moves tokens, it never changes them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmtrain.engine.data import BatchSampler, MarkovChain, build_data, microbatches, step_target_count
from llmtrain.engine.data.packing import pack_ffd
from llmtrain.recipe.schema import DataConfig
from tests.test_sft_data import EXAMPLE, chat_cfg, write_jsonl


# ---------------------------------------------------------------------------------------------
# packing


def naive_ffd(lengths, capacity):
    free, rows = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
        if r is None:
            free.append(capacity)
            rows.append([])
            r = len(free) - 1
        free[r] -= lengths[i]
        rows[r].append(i)
    return [sorted(r) for r in rows]


def test_pack_ffd_equals_naive_first_fit_decreasing():
    rng = np.random.default_rng(0)
    for n, cap in ((1, 8), (7, 8), (300, 64), (1000, 128)):
        lengths = rng.integers(1, cap + 1, size=n)
        start, items = pack_ffd(lengths, cap)
        rows = [items[start[r]:start[r + 1]].tolist() for r in range(len(start) - 1)]
        assert rows == naive_ffd(lengths.tolist(), cap)
        assert sorted(items.tolist()) == list(range(n)) and all(lengths[r].sum() <= cap for r in rows)


@pytest.mark.parametrize("source", ["chat", "instruction"])
def test_packed_rows_hold_whole_samples(tmp_path, source):
    """chat: the last token ("\n" after <|im_end|>) is no target; instruction: the last token (EOS) is one."""
    rng = np.random.default_rng(1)
    pairs = [("".join(rng.choice(list("abcdef"), size=int(rng.integers(1, 40)))), "r" * int(rng.integers(1, 30))) for _ in range(60)]
    if source == "chat":
        rows = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]} for p, c in pairs]
    else:
        rows = [{"prompt": p, "completion": c} for p, c in pairs]
    cfg = DataConfig(source=source, path=str(write_jsonl(tmp_path / "c.jsonl", rows)), tokenizer=str(EXAMPLE / "tokenizer"))
    flat = build_data(cfg, 96, 512, 0)
    packed = build_data(cfg.model_copy(update={"packing": True}), 96, 512, 0)
    assert packed.packed and not flat.packed and packed.length < flat.length == 60
    assert packed.summary.target_tokens == flat.summary.target_tokens
    seen = []
    for r in range(packed.length):
        s = packed.sample(r)
        assert set(s) == {"inputs", "labels", "positions", "segments"} and all(v.shape == (96,) for v in s.values())
        members = packed.samples_of_row(r)
        seen += members
        at = 0
        for k, m in enumerate(members):
            n = int(flat.offsets[m + 1] - flat.offsets[m]) - 1
            ref = flat.sample(m)  # the unpacked row of the same sample
            seg = slice(at, at + n)
            assert s["inputs"][seg].tolist() == ref["inputs"][:n].tolist()
            assert s["labels"][seg].tolist() == ref["labels"][:n].tolist()
            assert s["positions"][seg].tolist() == list(range(n)) and (s["segments"][seg] == k).all()
            end = flat.offsets[m + 1] - 1  # the label of a sample's last input is its own last token (or none)
            assert s["labels"][at + n - 1] == (flat.tokens[end] if flat.targets[end] else -100)
            assert flat.targets[end] == (source == "instruction")
            at += n
        assert (s["segments"][at:] == -1).all() and (s["labels"][at:] == -100).all()
        assert packed.target_count(r) == int((s["labels"] != -100).sum())
    assert sorted(seen) == list(range(60))


# ---------------------------------------------------------------------------------------------
# micro-batches and step target counts


@pytest.mark.parametrize("packing", [False, True])
def test_step_target_count_equals_brute_force(tmp_path, packing):
    data = build_data(chat_cfg(EXAMPLE / "chat.jsonl", EXAMPLE / "tokenizer", packing=packing), 192, 512, 0)
    dp, micro, gbs = 2, 2, 8
    samplers = [BatchSampler(data.length, gbs, micro, r, dp, seed=3) for r in range(dp)]
    for _ in range(4):
        brute = 0
        for sampler in samplers:
            for batch in microbatches(data, sampler):
                assert len(batch) == (4 if packing else 2)
                assert all(t.dtype == torch.int64 and t.shape == (micro, 192) for t in batch)
                brute += int((batch[1] != -100).sum())
        counts = {step_target_count(data, s) for s in samplers}
        assert counts == {brute} and brute > 0
        for s in samplers:
            s.advance()
    assert step_target_count(MarkovChain(16, 8, 0), BatchSampler(None, 4, 2, 0, 2, 0)) is None
