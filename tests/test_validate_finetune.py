"""The fine-tuning rules of llmtrain.plan.validate (data sources, chat templates, packing, LoRA): the
path, the numbers in the message, the fix. Split from tests/test_validate.py by concept; same
debug-preset recipes (tests/helpers_plan.py)."""

from __future__ import annotations

from tests.helpers_plan import debug, find, paths, plan_of


def errors(data, **kw):
    return plan_of(data, **kw).validation.errors


def test_finetune_sources_need_a_path():
    for source in ("chat", "instruction", "text"):
        tok = "hf-tokenizer-dir" if source == "chat" else "byte"
        p = find(errors(debug({"data": {"source": source, "tokenizer": tok}})), "data.path",
                 f"source {source} reads samples from data.path")
        assert ".jsonl" in p.hint and (".txt" in p.hint) == (source == "text")
        assert plan_of(debug({"data": {"source": source, "tokenizer": tok, "path": "d.jsonl"}})).valid


def test_chat_needs_a_tokenizer_with_a_chat_template():
    for tok in ("byte", "bpe:512"):
        p = find(errors(debug({"data": {"source": "chat", "path": "c.jsonl", "tokenizer": tok}})), "data.tokenizer",
                 "source chat needs a chat template", repr(tok), "tokenizer_config.json")
        assert "Hugging Face tokenizer directory" in p.hint
    # instruction and text have no template: byte is fine
    assert plan_of(debug({"data": {"source": "instruction", "path": "i.jsonl", "tokenizer": "byte"}})).valid


def test_packing_needs_samples_and_runs_under_every_cp_method():
    """Packed rows need samples; under CP Ulysses' attention (whole rows), all-gather's (its rows of the
    whole row's mask) and the ring's blocks (views of those rows) take their mask."""
    p = find(errors(debug({"data": {"packing": True}})), "data.packing", "source synthetic already yields full")
    assert "data.packing: false" in p.hint
    find(errors(debug({"data": {"source": "memmap", "path": "m", "packing": True}})), "data.packing", "source memmap")
    assert plan_of(debug({"data": {"source": "text", "path": "t.txt", "packing": True}})).valid
    for method in ("ulysses", "allgather", "ring"):
        fine = {"data": {"source": "text", "path": "t.txt", "packing": True}, "parallel": {"cp": 2, "cp_method": method}}
        assert not [e for e in errors(debug(fine)) if e.path in ("data.packing", "parallel.cp_method")]


def test_lora_on_moe_adapts_attention_and_dense_layers_only():
    """LoRA on an MoE model: attention targets are valid; MLP targets adapt the dense layers only, said in a
    warning (routers and routed experts stay frozen); MLP targets on a model without a dense layer are an
    error (nothing would train)."""
    moe = plan_of(debug({"train": {"lora": {"rank": 4, "targets": ["wq", "wk", "wv", "wo"]}}}, preset="debug-moe"))
    assert moe.valid and not [w for w in moe.validation.warnings if w.path.startswith("train.lora")]
    mixed = plan_of(debug({"train": {"lora": {"rank": 4}}}, preset="debug-moe"))  # all-linear; layer 0 is dense
    assert mixed.valid
    w = find(mixed.validation.warnings, "train.lora.targets", "w1/w2/w3 adapt the 1 dense MLP layer(s) only",
             "3 MoE layers' routers and routed experts stay frozen")
    assert "wq, wk, wv, wo" in w.hint
    all_moe = {"model": {"moe": {"first_dense_layers": 0}}, "train": {"lora": {"rank": 4, "targets": ["w1", "w2"]}}}
    p = find(errors(debug(all_moe, preset="debug-moe")), "train.lora.targets", "nothing would train")
    assert "train.lora.experts: true" in p.hint and "add attention targets" in p.hint
    assert plan_of(debug({"train": {"lora": {"rank": 4, "targets": ["wq", "wv"]}}})).valid


def test_lora_experts_needs_moe_mlp_targets_and_no_dropout():
    """``train.lora.experts``: valid (and silent) with MLP targets on an MoE model, also when every layer is
    MoE; refused on a dense model, without an MLP target, and with adapter dropout."""
    experts = {"model": {"moe": {"first_dense_layers": 0}}, "train": {"lora": {"rank": 4, "targets": ["w1", "w2"],
                                                                                "experts": True}}}
    ok = plan_of(debug(experts, preset="debug-moe"))
    assert ok.valid and not [w for w in ok.validation.warnings if w.path.startswith("train.lora")]
    find(errors(debug({"train": {"lora": {"experts": True}}})), "train.lora.experts", "the model is dense")
    p = find(errors(debug({"train": {"lora": {"targets": ["wq"], "experts": True}}}, preset="debug-moe")),
             "train.lora.experts", "list no MLP projection")
    assert "w1, w2 and/or w3" in p.hint
    drop = {"train": {"lora": {"dropout": 0.1, "experts": True}}}
    find(errors(debug(drop, preset="debug-moe")), "train.lora.dropout", "no dropout")


def test_finetune_problems_are_reported_together():
    data = debug({"data": {"source": "chat", "packing": True},
                  "model": {"moe": {"first_dense_layers": 0}}, "train": {"lora": {"targets": ["w1"]}}}, preset="debug-moe")
    got = paths(errors(data))
    assert {"data.path", "data.tokenizer", "train.lora.targets"} <= set(got)
