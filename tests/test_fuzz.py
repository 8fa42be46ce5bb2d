"""Property tests: generated recipes and hostfiles through the CLI's code path never crash.

Each example is written to a real file and goes through exactly what ``llmtrain plan`` runs:
``make_plan(recipe_path, hosts=..., nodes=..., gpus_per_node=..., overrides=...)``, then
``plan_to_dict`` (and ``json.dumps``), then ``render_plan`` into a rich Console on a StringIO.
The only exception allowed is :class:`LLMTrainError`, and each of its problems (and each
error/warning of a returned plan) names where - a dotted recipe path, ``--set``/a flag, or
``file:LINE`` - and how to fix it.

Recipes: >= 1,000 examples, from mutating the shipped recipes (layout degrees in small ranges so
that many plans are valid and many hit each rule; deleted keys; wrong types; negative and huge
numbers such as 10**30 and 2**63; unknown keys; ``--set`` items) and from YAML that is not a
recipe (random text, binary garbage, empty files, lists, scalars, syntax errors, deep nesting).
Hostfiles: >= 200 examples of DeepSpeed and YAML forms, valid and broken, and garbage.
Hypothesis is derandomized so that CI runs are reproducible.
"""

from __future__ import annotations

import copy
import io
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from llmtrain.errors import LLMTrainError
from llmtrain.plan.api import make_plan
from llmtrain.plan.render import render_plan
from llmtrain.plan.report import plan_to_dict
from tests.helpers_plan import SHIPPED_RECIPES, assert_good_problem, recipe_dict

RECIPE_EXAMPLES = 1000
HOSTFILE_EXAMPLES = 250
FUZZ = dict(deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])

BASES = [recipe_dict(p) for p in SHIPPED_RECIPES]
HUGE = [10**30, -(10**30), 2**63, 2**24, 2**24 + 1, -1, 0, 10**6]
WRONG = ["8", "", True, None, [], {}, [1, "x"], 1.5, float("nan"), float("inf"), "x" * 300, {"a": 1}]
UNKNOWN_KEYS = ["bogus", "tpp", "Model", "", "a b", 1, True, "async_x", "ü"]
OVERRIDES = ["parallel.tp=2", "parallel.tp=3", "train.global_batch_size=null", "cluster.nodes=2",
             "parallel.dp_shard=-1", "model.moe.num_experts=4", "checkpoint.async=false", "new.section=1",
             "parallel.tp", "=3", "a..b=1", "model.preset.x=1", "train.seed=2020-13-45", "parallel.tp=[",
             "parallel=3", "train.seed=!!int 0x", "model.layers=10000000000000000000000"]
NOT_RECIPES = ["", "\n\n", "# only a comment\n", "- 1\n- 2\n", "42", "null", "~", "'text'", "[", "{", "a: [",
               "a: b: c", "\t- x", "---\n---\n", "a: 1\n---\nb: 2\n", "!!python/object/apply:os.system ['true']",
               "a: !!binary x", "[" * 3000, "a: 2020-13-45", "a: &x [*x]", "? [a]\n: 1", "<<: 5", "\x00\x07",
               "model: {preset: debug-dense}\n\x85bad", "model:\n  preset: debug-dense\n bad-indent: 1\n"]


# -- recipe generators ----------------------------------------------------------------------------

def _paths(node, prefix=()):
    """Every key path in a nested dict (sections and leaves)."""
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.append((*prefix, key))
            out.extend(_paths(value, (*prefix, key)))
    return out


def _parent(data, path):
    for key in path[:-1]:
        data = data[key]
    return data


def _set_layout(draw, data):
    par = data.setdefault("parallel", {}) if isinstance(data.get("parallel"), dict) else data
    par["tp"] = draw(st.sampled_from([1, 1, 1, 2, 2, 4, 8, 3]))
    par["pp"] = draw(st.sampled_from([1, 1, 1, 1, 2, 4, 3]))
    par["cp"] = draw(st.sampled_from([1, 1, 1, 1, 2, 4]))
    par["ep"] = draw(st.sampled_from([1, 1, 1, 2, 4, 8]))
    par["dp_shard"] = draw(st.sampled_from([-1, -1, -1, 1, 2, 4]))
    par["dp_replicate"] = draw(st.sampled_from([1, 1, 1, 2]))
    par["pp_schedule"] = draw(st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"]))
    par["pp_virtual_stages"] = draw(st.sampled_from([1, 1, 1, 2, 2, 3]))
    par["cp_method"] = draw(st.sampled_from(["ring", "ulysses", "allgather"]))
    par["zero"] = draw(st.sampled_from([0, 1, 2, 3]))
    par["sequence_parallel"] = draw(st.booleans())
    if draw(st.integers(0, 3)):
        par.pop("pp_layers_per_stage", None)


def _fit_layout(draw, data):
    """A layout that fits the cluster (most such plans are valid; the model may still object)."""
    cluster = data["cluster"]
    gpus, world = cluster["gpus_per_node"], cluster["nodes"] * cluster["gpus_per_node"]
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if gpus % d == 0]))
    pp = draw(st.sampled_from([1, 2])) if (world // tp) % 2 == 0 else 1
    cp = draw(st.sampled_from([1, 2])) if (world // (tp * pp)) % 2 == 0 else 1
    dp = world // (tp * pp * cp)
    moe = data["model"].get("preset") in ("debug-moe", "mixtral-8x7b", "deepseek-v3")
    ep = draw(st.sampled_from([1, 2])) if moe and (dp * cp) % 2 == 0 else 1
    schedule, v = draw(st.sampled_from([("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zbv", 2)]))
    data["parallel"] = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "dp_shard": -1, "zero": draw(st.sampled_from([0, 1, 3])),
                        "pp_schedule": schedule, "pp_virtual_stages": v if pp > 1 else 1}
    micro = draw(st.sampled_from([1, 2]))
    data["train"] = {**data.get("train", {}), "seq_len": 128, "micro_batch_size": micro,
                     "global_batch_size": micro * dp * pp * draw(st.sampled_from([1, 2, 4]))}


def _set_batch(draw, data):
    train = data.setdefault("train", {}) if isinstance(data.get("train"), dict) else data
    train["global_batch_size"] = draw(st.sampled_from([None, None, 1, 4, 8, 12, 16, 32, 64, 96, 256]))
    train["micro_batch_size"] = draw(st.sampled_from([1, 1, 1, 2, 3, 4]))
    train["seq_len"] = draw(st.sampled_from([128, 128, 256, 256, 100, 129, 512, 1024, 4096, 200000]))
    train["steps"] = draw(st.sampled_from([1, 10, 100]))


def _set_model(draw, data):
    model = data.get("model")
    if not isinstance(model, dict):
        return
    model["preset"] = draw(st.sampled_from(["debug-dense", "debug-moe", "llama3-8b", "mixtral-8x7b", "deepseek-v3"]))
    for key, choices in (("heads", [4, 6, 8, 32]), ("kv_heads", [1, 2, 3, 4, 8]), ("hidden", [96, 100, 120, 128]),
                         ("layers", [2, 4, 6, 12, 13]), ("ffn_hidden", [350, 352]), ("vocab_size", [510, 512])):
        if draw(st.integers(0, 3)) == 0:
            model[key] = draw(st.sampled_from(choices))
    if draw(st.integers(0, 2)) == 0:
        model["moe"] = {k: draw(st.sampled_from(v)) for k, v in
                        (("num_experts", [1, 2, 4, 8]), ("top_k", [1, 2, 8]), ("first_dense_layers", [0, 1, 4]))
                        if draw(st.booleans())}


def _delete(draw, data):
    paths = _paths(data)
    if paths:
        path = draw(st.sampled_from(paths))
        del _parent(data, path)[path[-1]]


def _inject(values):
    def mutate(draw, data):
        paths = _paths(data)
        if paths:
            path = draw(st.sampled_from(paths))
            _parent(data, path)[path[-1]] = draw(st.sampled_from(values))
    return mutate


def _unknown_key(draw, data):
    sections = [p for p in _paths(data) if isinstance(_parent(data, p)[p[-1]], dict)]
    target = data
    if sections and draw(st.booleans()):
        path = draw(st.sampled_from(sections))
        target = _parent(data, path)[path[-1]]
    if isinstance(target, dict):
        target[draw(st.sampled_from(UNKNOWN_KEYS))] = draw(st.sampled_from([1, "x", None]))


def _small_values(draw, data):
    paths = [p for p in _paths(data) if isinstance(_parent(data, p)[p[-1]], int)]
    if paths:
        path = draw(st.sampled_from(paths))
        _parent(data, path)[path[-1]] = draw(st.integers(-3, 20))


MUTATIONS = [_set_layout, _set_layout, _set_batch, _set_model, _delete, _inject(WRONG), _inject(HUGE),
             _unknown_key, _small_values]


@st.composite
def mutated_recipes(draw):
    data = copy.deepcopy(draw(st.sampled_from(BASES)))
    # small clusters: layouts stay cheap to print, and degrees decide validity
    data.setdefault("cluster", {}).update(nodes=draw(st.sampled_from([1, 1, 2, 4])),
                                          gpus_per_node=draw(st.sampled_from([1, 2, 4, 8])))
    if draw(st.integers(0, 3)) == 0:
        _set_model(draw, data)
    if draw(st.booleans()):
        _fit_layout(draw, data)
    else:
        if draw(st.integers(0, 3)):
            _set_layout(draw, data)
        if draw(st.integers(0, 2)):
            _set_batch(draw, data)
    if draw(st.booleans()):  # half the recipes stay well-formed: their layouts decide validity
        for mutate in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3)):
            mutate(draw, data)
    return _dump(data).encode()


def _dump(value) -> str:
    return yaml.dump(value, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False, allow_unicode=True)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

not_recipes = st.one_of(
    st.sampled_from(NOT_RECIPES).map(str.encode),
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    json_values.map(lambda v: _dump(v).encode()),
    st.dictionaries(st.sampled_from(["model", "parallel", "train", "data", "cluster", "checkpoint", "name", "x"]),
                    json_values, max_size=5).map(lambda v: _dump(v).encode()),
)

flags = st.one_of(st.none(), st.none(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, -1, 2**24, 2**30]))


@st.composite
def recipe_cases(draw):
    # (st.one_of flattens nested one_ofs, which would make each garbage kind as likely as a recipe)
    content = draw(not_recipes) if draw(st.integers(0, 3)) == 0 else draw(mutated_recipes())
    overrides = draw(st.lists(st.sampled_from(OVERRIDES), max_size=2)) if draw(st.integers(0, 6)) == 0 else []
    nodes = draw(flags) if draw(st.integers(0, 6)) == 0 else None
    gpus = draw(flags) if draw(st.integers(0, 6)) == 0 else None
    return content, overrides, nodes, gpus


# -- hostfile generators --------------------------------------------------------------------------

HOSTS = ["worker-1", "worker-2", "w3", "10.0.0.4", "[fe80::1]", "[a]", "node.example.com", "a b", "bad/host",
         "-x", "ümlaut", "x" * 300, "", "#", "worker-1"]
SLOTS = ["1", "2", "4", "8", "0", "-1", "1025", "\u00b2", "x", "", "8.0", "3"]


GOOD_HOSTS = ["worker-1", "worker-2", "w3", "10.0.0.4", "[fe80::1]", "[a]", "node.example.com", "gpu_7"]


@st.composite
def good_hostfiles(draw):
    hosts = draw(st.lists(st.sampled_from(GOOD_HOSTS), min_size=1, max_size=4, unique=True))
    slots = [draw(st.sampled_from([1, 2, 4, 8])) for _ in hosts]
    if draw(st.booleans()):
        doc = {"hosts": [{"host": h, "slots": n, **({"port": 22} if draw(st.booleans()) else {})}
                         for h, n in zip(hosts, slots)]}
        return _dump(doc).encode(), draw(st.sampled_from(["hosts.yaml", "hostfile"]))
    lines = [draw(st.sampled_from(["# cluster", ""]))]
    for h, n in zip(hosts, slots):
        lines.append(f"{h} slots={n}" + draw(st.sampled_from(["", "  # comment", "\t"])))
        if draw(st.integers(0, 3)) == 0:
            lines.append(draw(st.sampled_from(["", "   ", "# c"])))
    return "\n".join(lines).encode(), "hosts"


@st.composite
def deepspeed_hostfiles(draw):
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 9))
        if kind == 0:
            lines.append(draw(st.sampled_from(["", "   ", "# comment", "\t"])))
        elif kind == 1:
            lines.append(draw(st.text(max_size=30)))
        else:
            host, slots = draw(st.sampled_from(HOSTS)), draw(st.sampled_from(SLOTS))
            line = draw(st.sampled_from([f"{host} slots={slots}", f"{host} slots={slots}  # c", f"{host}",
                                         f"{host} {slots}", f"{host} slots={slots} extra"]))
            lines.append(line)
    return "\n".join(lines).encode(), draw(st.sampled_from(["hosts", "hostfile.txt"]))


@st.composite
def yaml_hostfiles(draw):
    entries = []
    for _ in range(draw(st.integers(0, 5))):
        entry = {"host": draw(st.sampled_from(HOSTS)), "slots": draw(st.sampled_from([1, 2, 4, 8, 0, -1, "8", None]))}
        for key, values in (("user", ["ubuntu", "", 5]), ("port", [22, 2222, 0, 70000, "22"]),
                            ("identity_file", ["~/.ssh/id", ""]), ("gpus", [8])):
            if draw(st.integers(0, 3)) == 0:
                entry[key] = draw(st.sampled_from(values))
        if draw(st.integers(0, 9)) == 0:
            del entry[draw(st.sampled_from(["host", "slots"]))]
        entries.append(entry)
    doc = {"hosts": entries}
    if draw(st.booleans()):
        doc["known_hosts"] = draw(st.sampled_from(["~/.ssh/k", "", 5]))
    if draw(st.integers(0, 5)) == 0:
        doc[draw(st.sampled_from(["extra", "host"]))] = 1
    if draw(st.integers(0, 5)) == 0:
        doc = draw(st.sampled_from([entries, "hosts", 5, None]))
    text = _dump(doc)
    return text.encode(), draw(st.sampled_from(["hosts.yaml", "hosts.yml", "hostfile"]))


garbage_hostfiles = st.tuples(
    st.one_of(st.binary(max_size=100), st.sampled_from(NOT_RECIPES).map(str.encode),
              st.text(max_size=100).map(lambda t: ("hosts:\n" + t).encode())),
    st.sampled_from(["hosts", "hosts.yaml"]),
)

HOST_RECIPES = {
    "flex.yaml": "model: {preset: debug-dense}\ntrain: {seq_len: 128}\nparallel: {zero: 0}\n",
    "debug.yaml": (SHIPPED_RECIPES[0].parent / "debug.yaml").read_text(),
    "moe.yaml": "model: {preset: debug-moe}\ntrain: {seq_len: 128}\nparallel: {ep: 2}\n",
}


# -- the code path under test ------------------------------------------------------------------------

class _TopKeys:
    """The recipe's top-level keys (and --set's), parsed only when a problem's path needs them."""

    def __init__(self, path: Path, overrides):
        self.path, self.overrides, self.keys = path, overrides, None

    def __iter__(self):
        if self.keys is None:
            self.keys = [item.split("=", 1)[0].split(".", 1)[0] for item in self.overrides]
            try:
                top = yaml.load(self.path.read_bytes(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
                self.keys += list(top) if isinstance(top, dict) else []
            except Exception:  # noqa: BLE001 - only to learn which top-level keys the file has
                pass
        return iter(self.keys)


def run_plan(recipe_path: Path, hosts: Path | None = None, nodes=None, gpus=None, overrides=()) -> tuple[str, set[str]]:
    """Run the CLI's code path and check the contract; return 'valid', 'invalid' or 'error' and
    the paths of the plan's errors."""
    files = tuple(str(p) for p in (recipe_path, hosts) if p is not None)
    keys = _TopKeys(recipe_path, overrides)
    try:
        plan = make_plan(recipe_path, hosts=hosts, nodes=nodes, gpus_per_node=gpus, overrides=list(overrides))
    except LLMTrainError as exc:
        assert exc.problems
        for problem in exc.problems:
            assert_good_problem(problem, files, keys)
        return "error", set()
    data = plan_to_dict(plan)
    assert isinstance(data["valid"], bool) and data["valid"] == (not data["errors"])
    json.loads(json.dumps(data))
    console = Console(file=io.StringIO(), width=120)
    render_plan(data, console)
    text = console.file.getvalue()
    assert "llmtrain plan" in text
    for problem in [*plan.validation.errors, *plan.validation.warnings]:
        assert_good_problem(problem, files, keys)
        assert problem.path in text
    if data["valid"]:
        assert data["layout"] is not None and data["batch"] is not None
        assert len(data["layout"]["rank_coords"]) == data["world_size"]
        return "valid", set()
    assert data["layout"] is None
    return "invalid", {p.path for p in plan.validation.errors}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def test_fuzz_recipes(workdir):
    outcomes: Counter[str] = Counter()
    rules: Counter[str] = Counter()
    recipe = workdir / "recipe.yaml"

    @settings(max_examples=RECIPE_EXAMPLES, **FUZZ)
    @given(recipe_cases())
    def check(case):
        content, overrides, nodes, gpus = case
        recipe.write_bytes(content)
        outcome, error_paths = run_plan(recipe, None, nodes, gpus, overrides)
        outcomes[outcome] += 1
        rules.update(error_paths)

    check()
    print(f"\nrecipes: {dict(outcomes)}; errors by path: {dict(rules.most_common())}")
    assert sum(outcomes.values()) >= RECIPE_EXAMPLES, outcomes
    # valid plans, invalid layouts and rejected files all occur often
    assert min(outcomes["valid"], outcomes["invalid"], outcomes["error"]) >= 100, outcomes
    for path in ("parallel", "parallel.tp", "parallel.ep", "parallel.pp_virtual_stages", "model.layers",
                 "train.global_batch_size", "train.seq_len", "model.kv_heads"):
        assert rules[path] >= 5, (path, rules)  # the common rules; each rule has its own test in test_validate


def test_fuzz_hostfiles(workdir):
    outcomes: Counter[str] = Counter()
    for name, text in HOST_RECIPES.items():
        (workdir / name).write_text(text)

    @settings(max_examples=HOSTFILE_EXAMPLES, **FUZZ)
    @given(st.data(), st.sampled_from(sorted(HOST_RECIPES)))
    def check(data, recipe_name):
        kind = data.draw(st.sampled_from(["good", "good", "deepspeed", "yaml", "garbage"]))
        strategy = {"good": good_hostfiles(), "deepspeed": deepspeed_hostfiles(), "yaml": yaml_hostfiles(),
                    "garbage": garbage_hostfiles}[kind]
        content, name = data.draw(strategy)
        hosts = workdir / "hosts" / name
        hosts.parent.mkdir(exist_ok=True)
        hosts.write_bytes(content)
        outcomes[run_plan(workdir / recipe_name, hosts)[0]] += 1

    check()
    print(f"\nhostfiles: {dict(outcomes)}")
    assert sum(outcomes.values()) >= HOSTFILE_EXAMPLES, outcomes
    assert outcomes["valid"] >= 40 and outcomes["error"] >= 50, outcomes
