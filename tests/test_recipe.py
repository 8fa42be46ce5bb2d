"""Recipes: shipped files, presets, ``--set`` overrides, strict types, errors, dump, JSON Schema."""

from __future__ import annotations

import pytest

from llmtrain.errors import LLMTrainError
from llmtrain.plan.api import make_plan
from llmtrain.recipe.load import dump_recipe, load_recipe, load_recipe_text
from llmtrain.recipe.presets import PRESETS
from llmtrain.recipe.schema import Recipe
from tests.helpers_plan import SHIPPED_RECIPES, find


def problems_of(text: str, overrides=None, source="r.yaml"):
    with pytest.raises(LLMTrainError) as info:
        load_recipe_text(text, overrides, source=source)
    return info.value.problems


# -- shipped recipes ------------------------------------------------------------------------------

def test_shipped_recipes_exist():
    names = {p.stem for p in SHIPPED_RECIPES}
    assert {"debug", "debug-moe", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3"} <= names


@pytest.mark.parametrize("path", SHIPPED_RECIPES, ids=lambda p: p.stem)
def test_shipped_recipe_validates_on_its_cluster(path):
    plan = make_plan(path)
    assert plan.valid, [e.line() for e in plan.validation.errors]
    recipe = plan.recipe
    assert recipe.name == path.stem
    assert plan.placement.world_size == recipe.cluster.nodes * recipe.cluster.gpus_per_node
    assert plan.validation.dims.world_size == plan.placement.world_size
    assert plan.validation.batch.global_batch_size == (recipe.train.global_batch_size
                                                       or recipe.train.micro_batch_size * plan.validation.dims.dp)


@pytest.mark.parametrize("path", SHIPPED_RECIPES, ids=lambda p: p.stem)
def test_shipped_recipe_fits_its_gpus(path):
    """A bundled recipe is an example to copy: the planner must find it fitting the memory of its
    cluster's GPUs on every pipeline rank (deepseek-v3 planned 173 GiB of 74.5 before it took full
    recomputation: its comment says why)."""
    from llmtrain.plan.costmodel import estimate  # noqa: PLC0415

    plan = make_plan(path)
    cost = estimate(plan.recipe, plan.validation.dims, plan.validation.batch, plan.placement, hints=False)
    assert cost.fits, (path.stem, cost.worst.peak / 2**30, cost.gpu.memory_bytes / 2**30)


def test_seed_layouts_match_their_papers():
    """The shipped big recipes reproduce the published layouts (see each file's comment)."""
    dims = make_plan(SHIPPED_RECIPES[0].parent / "llama3-405b.yaml").validation.dims
    assert (dims.tp, dims.pp, dims.dp, dims.world_size) == (8, 16, 128, 16384)
    dims = make_plan(SHIPPED_RECIPES[0].parent / "deepseek-v3.yaml").validation.dims
    assert (dims.pp, dims.ep, dims.dp_shard, dims.edp, dims.world_size) == (16, 64, 128, 2, 2048)
    dims = make_plan(SHIPPED_RECIPES[0].parent / "mixtral-8x7b.yaml").validation.dims
    assert (dims.tp, dims.ep, dims.dp_shard, dims.edp) == (2, 8, 32, 4)


# -- presets ----------------------------------------------------------------------------------------

def test_preset_fills_the_model():
    m = load_recipe_text("model: {preset: llama3-70b}").model
    for key, value in PRESETS["llama3-70b"].items():
        assert getattr(m, key) == value
    assert not m.is_moe


def test_explicit_fields_override_the_preset():
    m = load_recipe_text("model: {preset: llama3-8b, layers: 16, vocab_size: 32000}").model
    assert (m.layers, m.vocab_size, m.hidden, m.heads) == (16, 32000, 4096, 32)


def test_moe_preset_merges_per_field():
    m = load_recipe_text("model: {preset: mixtral-8x7b, moe: {top_k: 1}}").model
    assert (m.moe.num_experts, m.moe.top_k, m.moe.router, m.moe.aux_loss_coef) == (8, 1, "softmax", 0.02)


def test_moe_preset_can_be_made_dense():
    m = load_recipe_text("model: {preset: mixtral-8x7b, moe: {num_experts: 1}}").model
    assert not m.is_moe and m.moe.model_fields_set == {"num_experts"}


def test_custom_model_without_preset():
    text = ("model: {layers: 2, hidden: 64, heads: 4, kv_heads: 2, ffn_hidden: 128, vocab_size: 100,"
            " max_seq_len: 256, rope_theta: 10000.0, norm_eps: 1.0e-5, tie_embeddings: true}")
    m = load_recipe_text(text).model
    assert m.preset is None and m.head_dim == 16 and m.tie_embeddings


def test_incomplete_model_without_preset():
    p = find(problems_of("model: {layers: 2}"), "model", "missing hidden, heads")
    assert "model.preset" in p.hint and "llama3-8b" in p.hint


def test_unknown_preset():
    p = find(problems_of("model: {preset: llama-9000}"), "model.preset", "unknown preset 'llama-9000'")
    assert all(name in p.hint for name in PRESETS)


def test_model_is_required():
    p = find(problems_of("train: {steps: 3}"), "model", "required")
    assert p.hint


# -- --set overrides -------------------------------------------------------------------------------

def test_set_overrides_nested_keys():
    r = load_recipe_text("model: {preset: debug-dense}\nparallel: {tp: 1}",
                         ["parallel.tp=2", "train.optimizer.lr=0.01", "train.optimizer.betas=[0.8, 0.9]",
                          "model.moe.num_experts=1"])
    assert r.parallel.tp == 2 and r.train.optimizer.lr == 0.01 and r.train.optimizer.betas == [0.8, 0.9]


def test_set_creates_new_sections():
    r = load_recipe_text("model: {preset: debug-dense}", ["checkpoint.interval=5", "cluster.gpus_per_node=2"])
    assert r.checkpoint.interval == 5 and r.cluster.gpus_per_node == 2


def test_set_value_is_yaml():
    r = load_recipe_text("model: {preset: debug-dense}\ntrain: {global_batch_size: 8}",
                         ["train.global_batch_size=null", "data.path=/data/x", "train.compile=true"])
    assert r.train.global_batch_size is None and r.data.path == "/data/x" and r.train.compile is True


def test_set_goes_through_make_plan(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {preset: debug-dense}\ntrain: {seq_len: 128}\n")
    plan = make_plan(path, nodes=1, gpus_per_node=4, overrides=["parallel.tp=2"])
    assert plan.valid and plan.validation.dims.tp == 2 and plan.recipe.name == "r"


@pytest.mark.parametrize("item", ["parallel.tp", "=2", "parallel..tp=2", ".tp=2", ""])
def test_set_invalid_form(item):
    p = find(problems_of("model: {preset: debug-dense}", [item]), "--set", "is not KEY=VALUE")
    assert "--set parallel.tp=2" in p.hint


def test_set_into_a_value():
    p = find(problems_of("model: {preset: debug-dense}", ["model.preset.x=1"]), "model.preset", "is a value, not a section")
    assert p.hint == "override a leaf key"


def test_set_unparseable_yaml_value_is_kept_as_text():
    """A value YAML cannot construct (bad date, bad hex) is a type error on the field, not a crash."""
    for value in ("2020-13-45", "!!int 0x", "!!float x", "[1, 2"):
        p = find(problems_of("model: {preset: debug-dense}", [f"train.seed={value}"]), "train.seed")
        assert "whole number" in p.hint


def test_set_wrong_type_is_reported_at_its_path():
    p = find(problems_of("model: {preset: debug-dense}", ["parallel.tp=two"]), "parallel.tp", "'two'")
    assert p.hint == "write a whole number without quotes"


# -- strict types, ranges and keys -----------------------------------------------------------------

@pytest.mark.parametrize("snippet, path, hint", [
    ('train: {seq_len: "8"}', "train.seq_len", "write a whole number without quotes"),
    ("parallel: {tp: true}", "parallel.tp", "write a whole number without quotes"),
    ("parallel: {tp: 2.5}", "parallel.tp", "write a whole number without quotes"),
    ("train: {compile: 1}", "train.compile", "write true or false"),
    ('train: {optimizer: {lr: "3e-4"}}', "train.optimizer.lr", "write a number without quotes"),
    ("data: {tokenizer: 5}", "data.tokenizer", "write a string"),
    ("train: {optimizer: {betas: [0.9]}}", "train.optimizer.betas", "write a YAML list of the right length"),
])
def test_strict_types(snippet, path, hint):
    p = find(problems_of("model: {preset: debug-dense}\n" + snippet), path)
    assert p.hint == hint


@pytest.mark.parametrize("snippet, path", [
    ("parallel: {tp: 0}", "parallel.tp"), ("parallel: {tp: -4}", "parallel.tp"),
    ("train: {steps: 1000000000000000000000000000000}", "train.steps"),
    ("cluster: {gpus_per_node: 4096}", "cluster.gpus_per_node"),
    ("train: {optimizer: {lr: -1.0}}", "train.optimizer.lr"),
])
def test_ranges(snippet, path):
    p = find(problems_of("model: {preset: debug-dense}\n" + snippet), path)
    assert p.hint == "use a value in the allowed range"


def test_dp_shard_zero():
    p = find(problems_of("model: {preset: debug-dense}\nparallel: {dp_shard: 0}"), "parallel.dp_shard", "dp_shard is 0")
    assert "-1" in p.hint


@pytest.mark.parametrize("snippet, path, allowed", [
    ("parallel: {pp_schedule: 2f2b}", "parallel.pp_schedule", "gpipe"),
    ("parallel: {zero: 4}", "parallel.zero", "0, 1, 2, 3"),
    ("cluster: {gpu: v100}", "cluster.gpu", "h100-sxm"),
])
def test_literals_list_allowed_values(snippet, path, allowed):
    p = find(problems_of("model: {preset: debug-dense}\n" + snippet), path, "is not allowed")
    assert p.hint.startswith("use one of:") and allowed in p.hint


def test_unknown_key_lists_valid_keys():
    errs = problems_of("model: {preset: debug-dense}\nparallel: {tpp: 2}\ntrian: {}")
    p = find(errs, "parallel.tpp", "unknown key")
    assert p.hint.startswith("did you mean parallel.tp or parallel.pp? valid keys here: ")
    assert "tp, pp, cp, ep, dp_replicate, dp_shard" in p.hint
    p = find(errs, "trian", "unknown key")
    assert p.hint.startswith("did you mean train? ") and "model, parallel, train, data, checkpoint, cluster" in p.hint
    p = find(problems_of("model: {preset: debug-dense, moe: {topk: 2}}"), "model.moe.topk", "unknown key")
    assert p.hint.startswith("did you mean model.moe.top_k? ")
    # the same name in another section: the key the user had in mind, one level off
    for typo, meant in (("train: {lr: 0.1}", "train.optimizer.lr"), ("parallel: {seq_len: 8}", "train.seq_len"),
                        ("train: {warmup_steps: 3}", "train.schedule.warmup_steps"), ("train: {tp: 2}", "parallel.tp")):
        (p,) = problems_of(f"model: {{preset: debug-dense}}\n{typo}")
        assert p.message == "unknown key" and p.hint.startswith(f"did you mean {meant}? valid keys here: "), p.line()
    (p,) = problems_of("model: {preset: debug-dense}\ntrain: {optimizer: {learning_rate: 1}}")
    assert p.hint == "valid keys here: lr, betas, weight_decay, eps, states"  # nothing close: only the list


def test_several_field_errors_at_once():
    errs = problems_of("model: {preset: debug-dense}\nparallel: {tp: '2', pp: 0}\ntrain: {steps: x}")
    assert {"parallel.tp", "parallel.pp", "train.steps"} <= {p.path for p in errs}


def test_name_pattern():
    p = find(problems_of("name: '../etc'\nmodel: {preset: debug-dense}"), "name")
    assert "A-Za-z0-9" in p.hint


def test_checkpoint_async_alias():
    assert load_recipe_text("model: {preset: debug-dense}\ncheckpoint: {async: false}").checkpoint.async_ is False
    assert load_recipe_text("model: {preset: debug-dense}").checkpoint.async_ is True
    r = load_recipe_text("model: {preset: debug-dense}", ["checkpoint.async=false"])
    assert r.checkpoint.async_ is False and "async: false" in dump_recipe(r)


# -- dump round trip --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", SHIPPED_RECIPES, ids=lambda p: p.stem)
def test_dump_round_trips(path):
    recipe = load_recipe(path)
    again = load_recipe_text(dump_recipe(recipe))
    assert again == recipe
    assert again.model_dump() == recipe.model_dump()
    assert make_plan(path).valid  # and the lock file of a valid recipe is still valid:
    from llmtrain.plan.api import plan_recipe
    assert plan_recipe(again).valid, plan_recipe(again).validation.errors


def test_dump_keeps_overrides():
    r = load_recipe_text("model: {preset: mixtral-8x7b, moe: {top_k: 1}}", ["parallel.tp=2"])
    again = load_recipe_text(dump_recipe(r))
    assert again == r and again.model.moe.top_k == 1 and again.parallel.tp == 2


def test_dump_quotes_strings_the_loader_reads_as_numbers():
    """The loader reads YAML 1.2 floats (``1e5``); PyYAML's dumper wrote the string ``"1e5"`` plain, so
    a run named so had a recipe.lock.yaml its ranks and ``resume`` could not load (found through the
    secrets fuzz, whose random value ``97e44982000000`` came back as inf)."""
    r = load_recipe_text("model: {preset: debug-dense}\nname: '1e5'\ndata: {source: synthetic, tokenizer: '2E-3'}")
    text = dump_recipe(r)
    assert "name: '1e5'" in text
    again = load_recipe_text(text)
    assert again == r and again.name == "1e5" and again.data.tokenizer == "2E-3"


# -- files ----------------------------------------------------------------------------------------------

def test_empty_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(LLMTrainError) as info:
        load_recipe(path)
    p = find(info.value.problems, f"{path}:1", "empty")
    assert "model:" in p.hint


def test_comment_only_file_is_empty():
    find(problems_of("# nothing here\n"), "r.yaml:1", "empty")


@pytest.mark.parametrize("text, kind, line", [("- a\n- b\n", "list", 1), ("# c\n\n42\n", "int", 3),
                                               ("just text", "str", 1)])
def test_top_level_not_a_mapping(text, kind, line):
    p = find(problems_of(text), f"r.yaml:{line}", f"top level is a {kind}, not a mapping")
    assert "key: value" in p.hint


def test_yaml_syntax_error_names_line():
    p = find(problems_of("model: {preset: debug-dense}\ntrain:\n  seq_len: [1, 2\n  steps: 3\n"), "r.yaml:4", "invalid YAML")
    assert p.hint == "fix the YAML syntax there"
    p = find(problems_of("model: {preset: debug-dense}\nparallel:\n\ttp: 2\n"), "r.yaml:3", "invalid YAML")
    assert "column" in p.message


def test_yaml_value_error_names_line():
    find(problems_of("model: {preset: debug-dense}\ntrain:\n  seed: 2020-13-45\n"), "r.yaml:3", "month must be in 1..12")


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model: {preset: debug-dense}\nname: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(LLMTrainError) as info:
        load_recipe(path)
    p = find(info.value.problems, f"{path}:2", "not UTF-8 text (byte 38)")
    assert "UTF-8" in p.hint


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(LLMTrainError) as info:
        load_recipe(tmp_path / "nope.yaml")
    assert info.value.problems[0].path == str(tmp_path / "nope.yaml") and "not found" in str(info.value)
    with pytest.raises(LLMTrainError) as info:
        load_recipe(tmp_path)
    assert "is a directory" in str(info.value) and info.value.problems[0].hint


def test_huge_file(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("model: {preset: debug-dense}\n" + "# pad\n" * 200_000)
    with pytest.raises(LLMTrainError, match="over the 1 MiB limit"):
        load_recipe(path)


def test_alias_bomb_is_reported_quickly():
    """YAML aliases can describe a 10**8-element structure; the error must not print it."""
    lines = ["model: {preset: debug-dense}", "a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    errs = problems_of("\n".join(lines))
    assert {p.path for p in errs} == {f"a{i}" for i in range(9)}
    assert all(len(p.message) < 200 for p in errs)


def test_file_name_is_the_default_name(tmp_path):
    path = tmp_path / "my run.yaml"
    path.write_text("model: {preset: debug-dense}\n")
    assert load_recipe(path).name == "my-run"


# -- JSON Schema ------------------------------------------------------------------------------------------

def test_json_schema_describes_every_property():
    schema = Recipe.model_json_schema(by_alias=True)
    defs = schema["$defs"]
    models = {"Recipe": schema, **defs}
    assert {"ModelConfig", "MoEConfig", "ParallelConfig", "TrainConfig", "DataConfig", "CheckpointConfig",
            "ClusterConfig", "OptimizerConfig", "ScheduleConfig"} <= set(defs)
    count = 0
    for name, model in models.items():
        assert model.get("description"), name
        assert model.get("additionalProperties") is False, name
        for key, prop in model["properties"].items():
            # pydantic drops a field's description when it equals the referenced model's docstring
            ref = prop.get("$ref", "").rsplit("/", 1)[-1]
            text = prop.get("description") or defs.get(ref, {}).get("description")
            assert text and text.strip(), f"{name}.{key} has no description"
            count += 1
    assert count > 60
    assert "async" in defs["CheckpointConfig"]["properties"]


def test_recipe_doc_lists_every_key():
    """docs/recipe.md documents every recipe key and every preset."""
    from pydantic import BaseModel

    from tests.helpers_plan import REPO

    doc = (REPO / "docs" / "recipe.md").read_text()
    todo = [Recipe]
    while todo:
        model = todo.pop()
        for name, field in model.model_fields.items():
            assert f"`{field.alias or name}`" in doc, f"{model.__name__}.{name} missing from docs/recipe.md"
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                todo.append(field.annotation)
    from llmtrain.recipe.schema import MoEConfig, OptimizerConfig, ScheduleConfig
    for model in (MoEConfig, OptimizerConfig, ScheduleConfig):
        assert all(f"`{f.alias or n}`" in doc for n, f in model.model_fields.items())
    assert all(f"`{preset}`" in doc for preset in PRESETS)
