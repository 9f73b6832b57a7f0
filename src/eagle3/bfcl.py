"""BFCL tool-call prompts for `eagle3 eval --datasets bfcl`: acceptance on agentic traffic.

The Berkeley Function Calling Leaderboard (BFCL v4, gorilla-llm/gorilla `berkeley-function-call-leaderboard`,
Apache-2.0) ships its questions and JSON-schema functions in the `bfcl-eval` wheel. Its dependencies are
heavy and pinned, so it is installed without them (`INSTALL`) and read here as data, never imported:
`bfcl_eval/data/BFCL_v4_<category>.json`, one object per line with `id`, `question` (a list of turns, each a
list of messages) and `function` (the functions offered).

`bfcl_json_prompts()` gives the JSON-schema set (`eagle3 eval --datasets bfcl_json`): `JSON_PROMPTS` questions of
the simple category, each asking for the arguments of its function as a JSON object, constrained to the
function's parameter schema (`eagle3.decoding.grammar`).

`bfcl_prompts()` gives `PROMPTS` prompts, an even mix of three categories taken in turn (simple, multiple,
parallel; rows spread evenly over each file, so the order is fixed): the first turn's messages and the functions
as OpenAI tools. Functions are converted as BFCL converts them for function-calling models
(`bfcl_eval/model_handler/utils.py` `convert_to_tool`): "." in a name becomes "_" (OpenAI names allow neither
dots nor more than 64 characters), and BFCL's Python-flavoured types become JSON Schema types ("dict" ->
"object", "float" -> "number" with `format: float`, "tuple" -> "array", unknown -> "string";
`bfcl_eval/constants/type_mappings.py` `GORILLA_TO_OPENAPI`).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
from pathlib import Path

from eagle3.config import ConfigError

BFCL_VERSION = "2026.3.23"
INSTALL = f"pip install --no-deps bfcl-eval=={BFCL_VERSION}"
CATEGORIES = ("simple_python", "multiple", "parallel")  # file names: BFCL_v4_<category>.json
PROMPTS = 80
JSON_PROMPTS = 200

# BFCL type names -> JSON Schema (bfcl_eval/constants/type_mappings.py, GORILLA_TO_OPENAPI)
JSON_TYPES = {
    "integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
    "bool": "boolean", "array": "array", "list": "array", "dict": "object", "object": "object", "tuple": "array",
    "any": "string", "byte": "integer", "short": "integer", "long": "integer", "double": "number",
    "char": "string", "ArrayList": "array", "Array": "array", "HashMap": "object", "Hashtable": "object",
    "Queue": "array", "Stack": "array", "Any": "string", "String": "string", "Bigint": "integer",
}


def data_dir() -> Path:
    """The folder of BFCL's data files in the installed bfcl-eval wheel; ConfigError naming the install command."""
    spec = importlib.util.find_spec("bfcl_eval")  # finds the package without running it
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0]) / "data" if folders else None
    if path is None or not all((path / f"BFCL_v4_{c}.json").is_file() for c in CATEGORIES):
        raise ConfigError(f"the bfcl set reads BFCL's questions from the bfcl-eval wheel, which is not installed: "
                          f"{INSTALL} (without its dependencies: it is read as data)")
    return path


def schema(node: object) -> object:
    """A BFCL parameter schema as JSON Schema (see the module docstring)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    kind = out.get("type")
    if isinstance(kind, str):
        out["type"] = JSON_TYPES.get(kind, "string")
        if kind == "float":  # as BFCL tells function-calling models
            out["format"] = "float"
            if isinstance(out.get("description"), str):
                out["description"] += " This is a float type value."
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: schema(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = schema(out[key])
    return out


def to_tool(function: dict) -> dict:
    """One BFCL function as an OpenAI tool `{"type": "function", "function": {...}}`."""
    f = copy.deepcopy(function)
    f["name"] = re.sub(r"\.", "_", f["name"])
    f["parameters"] = {**schema(f.get("parameters") or {}), "type": "object"}
    return {"type": "function", "function": f}


def _spread(rows: list, k: int) -> list:
    """k rows spread evenly over `rows` (BFCL files are grouped by topic)."""
    return [rows[i * len(rows) // k] for i in range(min(k, len(rows)))]


def bfcl_prompts(limit: int | None = None) -> list[tuple[list[dict], list[dict], str]]:
    """(messages, tools, category) for the first `limit` (at most `PROMPTS`) prompts of the mix."""
    folder = data_dir()
    n = PROMPTS if limit is None else min(limit, PROMPTS)
    per_category = math.ceil(PROMPTS / len(CATEGORIES))
    picked = []
    for category in CATEGORIES:
        with open(folder / f"BFCL_v4_{category}.json", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        picked.append([(row, category) for row in _spread(rows, per_category)])
    out = []
    for k in range(per_category):  # simple, multiple, parallel, simple, ...
        for rows in picked:
            if k < len(rows) and len(out) < n:
                row, category = rows[k]
                messages = [{"role": m["role"], "content": m["content"]} for m in row["question"][0]]
                out.append((messages, [to_tool(f) for f in row["function"]], category.removesuffix("_python")))
    return out


def bfcl_json_prompts(limit: int | None = None) -> list[tuple[list[dict], dict]]:
    """(messages, schema) for the first `limit` (at most `JSON_PROMPTS`) prompts of the JSON-schema set: a
    simple-category question and its function's description and parameter schema (no further properties), to be
    answered with the call's arguments as one JSON object."""
    with open(data_dir() / f"BFCL_v4_{CATEGORIES[0]}.json", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    n = JSON_PROMPTS if limit is None else min(limit, JSON_PROMPTS)
    out = []
    for row in _spread(rows, n):
        f = to_tool(row["function"][0])["function"]
        # a call's arguments: no properties beyond the function's (as OpenAI's strict function calling asks)
        f["parameters"]["additionalProperties"] = False
        question = "\n".join(m["content"] for m in row["question"][0] if m["role"] == "user")
        ask = (f"{question}\n\nAnswer with the arguments for the function `{f['name']}` ({f.get('description', '')})"
               f" as one JSON object following this schema:\n{json.dumps(f['parameters'])}")
        out.append(([{"role": "user", "content": ask}], f["parameters"]))
    return out
