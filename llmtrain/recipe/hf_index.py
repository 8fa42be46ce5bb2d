"""What an HF model directory holds, from its headers alone: tensor names, shapes, dtypes, files.

``--init-from-hf DIR`` is checked at launch time, before torchrun starts, and again by every
rank before it reads a byte of tensor data. Both use this module, which reads only JSON: the
optional ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file) and the
header of each safetensors file (an 8-byte little-endian length, then a JSON object
``name -> {dtype, shape, data_offsets}``). No torch import: the launcher stays light.

Decisions:

* **The directory is untrusted** (docs/security.md). Files are regular files inside it (the
  caller, :func:`llmtrain.engine.hf.files.check_hf_dir`, checks that); JSON is read with caps
  (:data:`INDEX_CAP`, :data:`HEADER_CAP` = safetensors' own 100 MB header limit); an index
  may name only plain file names in the directory (no ``/``, no ``..``).
* **Structure is checked like safetensors does, without reading data**: known dtypes, integer
  shapes, ``data_offsets`` that tile the data section exactly and agree with shape x dtype
  size, and a file that is as long as its header says (a truncated download is named here,
  not as a crash inside a rank). Every problem is one line naming the file and the tensor;
  all of them are reported at once.
* **The index is authoritative when present** (as in transformers): only the files it names
  are read, and a tensor it maps to a file must be in that file's header. Without an index
  every ``*.safetensors`` file is read, a name in two files is an error, and a split set
  ``NAME-0000i-of-0000N.safetensors`` with a member missing is named.
* **Against the model** (:func:`model_problems`): every HF tensor the family's tensor map
  (:func:`llmtrain.engine.hf.families.tensor_map`) asks for exists, with the shape our tensor
  implies (a stacked source: our shape without dim 0; a fused one: all its blocks' rows) and a
  floating-point dtype; any other tensor is unexpected, except RoPE ``inv_freq`` buffers that
  old exports carry and a redundant ``lm_head.weight`` of a tied model (some hub checkpoints
  store both).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from llmtrain.errors import Problem
from llmtrain.safeio import MIB, open_regular, printable

INDEX = "model.safetensors.index.json"
INDEX_CAP = 64 * MIB
HEADER_CAP = 100 * 1000 * 1000  # safetensors refuses larger headers too

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
SHARD_RE = re.compile(r"^(.+)-(\d{5})-of-(\d{5})\.safetensors$")
IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
HINT = "re-download or re-export the model directory"


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header describes it (no data read)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    key: str | None = None  # the name in the file when the model knows the tensor by another (a multimodal Gemma 3)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _problem(path: Path, message: str, flag: str, hint: str = HINT) -> Problem:
    return Problem(flag, f"{printable(path)}: {message}", hint)


def read_weight_map(directory: Path, flag: str) -> tuple[dict[str, str] | None, list[Problem]]:
    """``weight_map`` of ``DIR/model.safetensors.index.json`` (None: no index file)."""
    path = directory / INDEX
    if not os.path.lexists(path):
        return None, []
    from llmtrain.errors import LLMTrainError
    from llmtrain.safeio import read_regular

    try:
        raw = read_regular(path, "safetensors index", INDEX_CAP, field=flag)
        doc = json.loads(raw)
    except LLMTrainError as exc:
        return None, list(exc.problems)
    except (ValueError, RecursionError) as exc:
        return None, [_problem(path, f"not valid JSON ({printable(exc, 100)})", flag)]
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        return None, [_problem(path, "has no weight_map object of tensor name -> file name", flag)]
    bad = sorted({v for v in wmap.values() if not _plain_name(v)})
    if bad:
        return None, [_problem(path, f"weight_map names {printable(bad[0], 80)}, not a *.safetensors file in the "
                               "directory", flag)]
    return wmap, []


def _plain_name(name: str) -> bool:
    return (name.endswith(".safetensors") and "/" not in name and "\\" not in name and not name.startswith(".")
            and name.isprintable())


def read_header(path: Path, flag: str) -> tuple[dict[str, TensorHeader], list[Problem]]:
    """The tensors of one safetensors file from its header, and every structural problem."""
    fobj, size = open_regular(path, "safetensors file", field=flag)
    with fobj:
        head = fobj.read(8)
        if len(head) < 8:
            return {}, [_problem(path, f"not a safetensors file ({size} bytes, truncated)", flag)]
        n = int.from_bytes(head, "little")
        if n > HEADER_CAP or 8 + n > size:
            return {}, [_problem(path, f"not a safetensors file or truncated (header of {n} bytes, file of {size})",
                                 flag)]
        raw = fobj.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return {}, [_problem(path, "not a safetensors file (its header is not JSON)", flag)]
    if not isinstance(doc, dict):
        return {}, [_problem(path, "not a safetensors file (its header is not a JSON object)", flag)]
    out: dict[str, TensorHeader] = {}
    spans: list[tuple[int, int, str]] = []
    problems: list[Problem] = []
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        shown = printable(name, 80)
        if not isinstance(entry, dict):
            problems.append(_problem(path, f"tensor {shown}: header entry is not an object", flag))
            continue
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            problems.append(_problem(path, f"tensor {shown}: unknown dtype {printable(repr(dtype), 40)}", flag))
            continue
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(type(d) is int and 0 <= d < 2**48 for d in shape)):
            problems.append(_problem(path, f"tensor {shown}: shape {printable(repr(shape), 60)} is not a list of "
                                     "sizes", flag))
            continue
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            problems.append(_problem(path, f"tensor {shown}: bad data_offsets {printable(repr(offsets), 60)}", flag))
            continue
        want = math.prod(shape) * DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != want:
            problems.append(_problem(path, f"tensor {shown}: data_offsets span {offsets[1] - offsets[0]} bytes, "
                                     f"{dtype} {shape} needs {want}", flag))
            continue
        out[name] = TensorHeader(path, dtype, tuple(shape))
        spans.append((offsets[0], offsets[1], name))
    if problems:
        return out, problems
    data = size - 8 - n
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            return out, [_problem(path, f"tensor {printable(name, 80)}: data_offsets overlap or leave a gap "
                                  f"(starts at {begin}, previous ends at {end})", flag)]
        end = stop
    if end > data:
        return out, [_problem(path, f"truncated: its header needs {end} data bytes, the file holds {data}", flag)]
    if end < data:
        return out, [_problem(path, f"{data - end} bytes after the last tensor (not a valid safetensors file)", flag)]
    return out, problems


def missing_shards(names: list[str]) -> list[str]:
    """Members of ``NAME-0000i-of-0000N.safetensors`` sets that are absent from ``names``."""
    groups: dict[tuple[str, str], set[int]] = {}
    for n in names:
        m = SHARD_RE.match(n)
        if m:
            groups.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    return [f"{prefix}-{i:05d}-of-{total}.safetensors" for (prefix, total), have in sorted(groups.items())
            for i in range(1, int(total) + 1) if i not in have]


def hf_tensors(directory: Path, files: list[Path], weight_map: dict[str, str] | None,
               flag: str) -> tuple[dict[str, TensorHeader], list[Problem]]:
    """Every tensor of the directory (name -> header) and every problem of its files and index."""
    problems: list[Problem] = []
    headers: dict[Path, dict[str, TensorHeader]] = {}
    for f in files:
        found, bad = read_header(f, flag)
        headers[f] = found
        problems += bad
    tensors: dict[str, TensorHeader] = {}
    if weight_map is not None:
        for name, fname in weight_map.items():
            found = headers.get(directory / fname)
            if found is None:
                continue  # a missing file is named by check_hf_dir
            if name not in found:
                if not any(p.message.startswith(printable(directory / fname)) for p in problems):
                    problems.append(_problem(directory / INDEX, f"weight_map puts tensor {printable(name, 80)} in "
                                             f"{printable(fname, 80)}, whose header does not hold it", flag))
                continue
            tensors[name] = found[name]
        return tensors, problems
    for f, found in headers.items():
        for name, h in found.items():
            if name in tensors:
                problems.append(_problem(f, f"tensor {printable(name, 80)} is also in {tensors[name].file.name}",
                                         flag))
            tensors[name] = h
    return tensors, problems


def model_problems(tensors: dict[str, TensorHeader], tmap: dict, our_shapes: dict[str, tuple[int, ...]],
                   tied: bool, directory: Path, flag: str) -> list[Problem]:
    """Every way the directory's tensors differ from what the model needs (empty: it loads)."""
    problems: list[Problem] = []
    used: set[str] = set()
    for ours, shape in our_shapes.items():
        src = tmap.get(ours)
        if src is None:
            if ours == "output.weight" and tied:
                continue
            problems.append(Problem(flag, f"our tensor {ours} has no Hugging Face counterpart in the tensor map",
                                    "this model family cannot be loaded from Hugging Face weights"))
            continue
        want = tuple(shape[1:]) if src.stacked else tuple(shape)
        if src.rows is not None:  # a block of a fused tensor: the whole tensor's rows along its dim (families.hf_shape)
            want = want[:src.rows_dim] + (src.rows[2],) + want[src.rows_dim + 1:]
        for name in src.hf:
            if name in used:  # a fused tensor (Phi-3 qkv_proj): one check for its blocks
                continue
            used.add(name)
            h = tensors.get(name)
            if h is None:
                problems.append(Problem(flag, f"{printable(directory)}: no tensor {name} (the model's {ours})",
                                        "the weights do not hold the whole model; check the recipe's model section"))
            elif h.shape != want:
                problems.append(_problem(h.file, f"tensor {name} has shape {list(h.shape)}, the model needs "
                                         f"{list(want)} (for {ours})", flag,
                                         "the weights do not match the recipe's model"))
            elif h.dtype not in FLOAT_DTYPES:
                problems.append(_problem(h.file, f"tensor {name} has dtype {h.dtype}, not floating point "
                                         f"({'/'.join(FLOAT_DTYPES)})", flag, "use unquantized weights"))
    for name in sorted(set(tensors) - used):
        if IGNORED_RE.search(name) or (tied and name == "lm_head.weight"):
            continue
        problems.append(_problem(tensors[name].file, f"unexpected tensor {printable(name, 80)} (no counterpart in "
                                 "the recipe's model)", flag, "the weights are of another model or family"))
    return problems
