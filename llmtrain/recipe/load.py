"""Load a recipe from YAML, apply ``--set dotted.key=value`` overrides, and report errors.

Every failure is an :class:`~llmtrain.errors.LLMTrainError` listing all problems, each with
its dotted recipe path and a fix; nothing here raises anything else for bad input.
"""

from __future__ import annotations

import difflib
import re
import reprlib
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.recipe.schema import Recipe
from llmtrain.safeio import printable, read_text

MAX_RECIPE_BYTES = 1 << 20


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read ``path`` and return the validated recipe (name defaults to the file's stem)."""
    path = Path(path)
    text = read_text(path, "recipe", MAX_RECIPE_BYTES, field=printable(path),
                     hint="pass a YAML recipe file (shipped recipes are in recipes/)")
    return load_recipe_text(text, overrides, default_name=_safe_name(path.stem), source=printable(path))


def load_recipe_text(text: str, overrides: list[str] | None = None, default_name: str | None = None,
                     source: str = "recipe") -> Recipe:
    data = parse_yaml_mapping(text, source)
    for item in overrides or []:
        apply_override(data, item)
    if default_name and "name" not in data:
        data["name"] = default_name
    return validate_recipe_dict(data)


def parse_yaml_mapping(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=SafeLineLoader)
    except yaml.YAMLError as exc:
        line, column = yaml_error_position(exc, text)
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or "invalid YAML"
        where = f" (column {column})" if column else ""
        hint = getattr(exc, "hint", None) or "fix the YAML syntax there"
        raise LLMTrainError(f"invalid YAML{where}: {problem}", hint, path=f"{source}:{line}") from None
    except (RecursionError, ValueError, OverflowError, TypeError) as exc:  # absurd nesting
        raise LLMTrainError(f"cannot parse YAML ({type(exc).__name__})", "write a plain YAML mapping",
                            path=f"{source}:1") from None
    if data is None:
        raise LLMTrainError("the recipe is empty", "a recipe needs at least `model: {preset: ...}`", path=f"{source}:1")
    if not isinstance(data, dict):
        raise LLMTrainError(
            f"top level is a {type(data).__name__}, not a mapping",
            "write `key: value` pairs such as `model: {preset: debug-dense}`",
            path=f"{source}:{first_content_line(text)}",
        )
    return data


class SafeLineLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser: ~8x faster
    """SafeLoader for YAML as a person writes it.

    * value errors (``2020-13-45``, ``!!int 0x``) carry the line of the value;
    * floats follow YAML 1.2 (``3e-4``, ``1e5``, ``-2.5E-3`` are numbers; PyYAML's YAML 1.1
      resolver wants a dot and reads them as strings) — see :data:`YAML12_FLOAT`;
    * a key written twice in one mapping is an error naming the key and both lines (PyYAML
      silently keeps the last one). Keys merged in with ``<<:`` may be overridden, as YAML says.
    """

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:
            raise yaml.constructor.ConstructorError(None, None, f"cannot read value: {exc}", node.start_mark) from None

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                    seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # unhashable key: the constructor reports it
                    continue
                if first is not None:
                    raise DuplicateKeyError(key, first, key_node.start_mark)
        return super().construct_mapping(node, deep)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    def __init__(self, key: Any, first_line: int, mark):
        line = mark.line + 1
        super().__init__(None, None, f"duplicate key {_short(key)} (lines {first_line} and {line})", mark)
        self.hint = f"keep one of the two {_short(key)} entries"


# YAML 1.2 core schema floats (plus 1.1's forms PyYAML already knows, kept by its own resolver):
# 3e-4, 1E5, -2.5e-3, .5e1, 6.02e+23. Checked after PyYAML's int and float resolvers.
YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
SafeLineLoader.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+0123456789."))


class RecipeDumper(yaml.SafeDumper):
    """SafeDumper that quotes what :class:`SafeLineLoader` would read as something else: with
    PyYAML's YAML 1.1 resolver alone, the string ``"1e5"`` (a run name, a path, an env value) was
    written plain and read back as the float 100000.0, so a recipe.lock.yaml could not be loaded."""


RecipeDumper.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+0123456789."))


def yaml_dump(data: Any) -> str:
    """``data`` as YAML that :func:`parse_yaml_mapping` reads back equal (block style, keys in order)."""
    return yaml.dump(data, Dumper=RecipeDumper, sort_keys=False)


def yaml_error_position(exc: yaml.YAMLError, text: str) -> tuple[int, int | None]:
    """1-based (line, column) of a YAML error; column is None when only the line is known."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return mark.line + 1, mark.column + 1
    position = getattr(exc, "position", None)  # ReaderError: a character offset
    if isinstance(position, int):
        return text[:position].count("\n") + 1, None
    return 1, None


def first_content_line(text: str) -> int:
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip() and not line.lstrip().startswith(("#", "%", "---")):
            return number
    return 1


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the value is parsed as YAML."""
    key, sep, raw_value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise LLMTrainError(f"--set {item!r} is not KEY=VALUE", "use e.g. --set parallel.tp=2", path="--set")
    try:
        value = yaml.load(raw_value, Loader=SafeLineLoader) if raw_value.strip() else raw_value
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError, TypeError):
        value = raw_value  # not YAML: keep the text; the schema reports it if a string is not allowed
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise LLMTrainError(f"--set {key}: {where} is a value, not a section", "override a leaf key", path=where)
        node = child
    node[parts[-1]] = value


def validate_recipe_dict(data: dict[str, Any]) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise LLMTrainError([_problem_from_pydantic(err) for err in exc.errors()]) from None


def _problem_from_pydantic(err: dict[str, Any]) -> Problem:
    loc = [_key_text(part) for part in err.get("loc", ())]
    path = ".".join(loc)
    kind = err.get("type", "")
    got = _short(err.get("input"))
    if kind == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        guess = _did_you_mean(loc)
        listed = f"valid keys here: {', '.join(valid)}" if valid else "remove it"
        return Problem(path, "unknown key", f"did you mean {guess}? {listed}" if guess else listed)
    if kind == "invalid_key":  # a YAML key that is not a string (true, 1, null); loc holds it mangled
        key = err.get("input")
        valid = _valid_keys(loc[:-1])
        return Problem(".".join([*loc[:-1], _key_text(key)]), f"key {_short(key)} is not a name",
                       f"valid keys here: {', '.join(valid)}" if valid else "remove it")
    if kind == "missing":
        return Problem(path, "required", "add it to the recipe")
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return Problem(path, f"{got} is not allowed", f"use one of: {expected.replace(' or ', ', ')}")
    if kind == "value_error":
        message = str(err.get("msg", "")).removeprefix("Value error, ")
        text, _, hint = message.partition("; ")
        return Problem(path or "recipe", text, hint)
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return Problem(path or "recipe", f"expected a mapping, got {got}", "write `key: value` pairs under it")
    hint = _hint_for(kind, err)
    value = err.get("input")
    if kind in ("int_type", "int_from_float") and isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
        hint = f"write it as a whole number, e.g. {int(value)} (YAML reads {got} as a float)"
    return Problem(path or "recipe", f"{err.get('msg', 'invalid')}, got {got}", hint)


def _key_text(part: Any) -> str:
    """A path segment as the user can read it: odd keys ('', ' x', 'a.b', tabs) are quoted."""
    text = str(part)
    plain = text and text.isprintable() and "." not in text and not any(ch.isspace() for ch in text)
    return text if plain else repr(text)


def _hint_for(kind: str, err: dict[str, Any]) -> str:
    ctx = err.get("ctx", {}) or {}
    if kind.startswith(("greater", "less")) or kind.endswith("_than") or "equal" in kind:
        return "use a value in the allowed range"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "write a whole number without quotes"
    if kind in ("float_type", "float_parsing"):
        return "write a number without quotes"
    if kind in ("bool_type", "bool_parsing"):
        return "write true or false"
    if kind in ("string_type", "string_pattern_mismatch"):
        pattern = ctx.get("pattern")
        return f"write a string matching {pattern}" if pattern else "write a string"
    if kind in ("list_type", "too_short", "too_long"):
        return "write a YAML list of the right length"
    return "see `llmtrain schema` for the field's type"


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40


def _short(value: Any) -> str:
    # Bounded repr: YAML aliases can build "billion laughs" structures whose full repr never ends.
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _valid_keys(loc: list[str]) -> list[str]:
    model: type[BaseModel] | None = Recipe
    for part in loc:
        if model is None or part not in model.model_fields:
            return []
        model = _model_of(model.model_fields[part].annotation)
    if model is None:
        return []
    return [field.alias or name for name, field in model.model_fields.items()]


def _key_paths(model: type[BaseModel], prefix: str = "", depth: int = 0) -> list[str]:
    """Every key of the recipe schema as a dotted path (sections and leaves)."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        out.append(path)
        child = _model_of(field.annotation)
        if child is not None and depth < 6:
            out.extend(_key_paths(child, path + ".", depth + 1))
    return out


def _did_you_mean(loc: list[str]) -> str | None:
    """For an unknown key: a sibling spelled almost the same (``parallel.tpp`` -> tp or pp), else
    the same name in another section (``train.lr`` -> ``train.optimizer.lr``, ``parallel.seq_len``
    -> ``train.seq_len``), nearest to where it was written first."""
    name, parent = loc[-1], loc[:-1]
    close = difflib.get_close_matches(name, _valid_keys(parent), n=2, cutoff=0.8)
    if close:
        return " or ".join(".".join([*parent, c]) for c in close)
    same = [p for p in _key_paths(Recipe) if p.rsplit(".", 1)[-1] == name]
    if not same:
        return None
    here = ".".join(parent) + "."
    same.sort(key=lambda p: (not p.startswith(here) if parent else False, p.count("."), p))
    return " or ".join(same[:2])


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def _safe_name(stem: str) -> str | None:
    cleaned = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in stem).lstrip("._-")[:128]
    return cleaned or None


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (presets expanded): what ``recipe.lock.yaml`` holds."""
    data = recipe.model_dump(mode="json", by_alias=True)
    moe = recipe.model.moe
    if not recipe.model.is_moe:
        # Only what differs from the defaults: reloading must not read every default MoE field of
        # a dense model as "set" (plan.validate rejects MoE settings on a dense model).
        data["model"]["moe"] = {"num_experts": moe.num_experts, **moe.model_dump(mode="json", exclude_defaults=True)}
    return yaml_dump(data)


