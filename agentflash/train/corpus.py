"""Synthetic agent-traffic corpus for the demo model.

Four kinds of conversation, all rendered later with the chat template in the Qwen3/Hermes format:

- ``tool_call``: randomly generated tool schemas (every JSON type, nested objects, enums, arrays,
  required and optional fields), a user request that names the values, one or several (parallel)
  ``<tool_call>`` blocks, the ``<tool_response>`` and a short answer; sometimes no call is needed.
- ``code``: real short functions of the Python standard library, asked for by their docstring.
- ``math``: word problems with worked calculations.
- ``prose``: docstrings of the Python standard library (real English text found on every machine
  that has Python), asked for as explanations.

Everything is deterministic given the seed, so the corpus is reproducible.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

Message = dict[str, Any]

VERBS = (
    "get create update delete list find search send book cancel convert compute check fetch "
    "schedule lookup translate summarize add remove reserve track order validate estimate rate "
    "register query set start stop open close analyze generate calculate resolve notify"
).split()
NOUNS = (
    "weather flight hotel invoice order user account message email event meeting ticket "
    "product review payment stock price route file document report task note reminder song "
    "playlist movie recipe restaurant car train package shipment contact calendar device "
    "sensor alarm budget expense loan rate currency image video post comment city country"
).split()
PARAM_WORDS = (
    "name city country date time count limit query text title body amount price currency "
    "quantity email phone address street zip code language format unit category status "
    "priority level color size width height weight age year month day start end source "
    "destination origin id user_id order_id item items tags notes label mode radius "
    "latitude longitude temperature duration days hours minutes passengers guests rating "
    "score threshold max_results sort_by include_details verbose recursive public"
).split()
WORDS = (
    "alpha river stone garden paris london tokyo berlin madrid rome oslo lima cairo delhi "
    "sydney toronto blue green red orange silver golden quick quiet bright north south east "
    "west morning evening summer winter spring autumn coffee tea bread apple mango piano "
    "guitar violin report draft final urgent weekly daily monthly project phoenix atlas "
    "orion nova delta echo harbor valley mountain ocean forest meadow"
).split()
FIRST_NAMES = (
    "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy".split()
)
ITEMS = "apples pencils books marbles coins stickers cookies cards boxes bottles tickets".split()
DESCRIPTIONS = (
    "Use this to {verb} a {noun}.",
    "{Verb} the {noun} with the given parameters.",
    "{Verb} one {noun} and return the result.",
    "Tool that can {verb} a {noun} for the user.",
    "{Verb} {noun} records.",
)


@dataclass(frozen=True)
class CorpusConfig:
    """How many conversations of each kind the corpus holds."""

    seed: int = 0
    num_tool_call: int = 24000
    num_code: int = 4000
    num_math: int = 6000
    num_prose: int = 6000


# --- tool schemas -------------------------------------------------------------------------------


def random_tool(rng: random.Random) -> dict[str, Any]:
    """An OpenAI-format tool with a random name, description and parameter schema."""
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    name = f"{verb}_{noun}" if rng.random() < 0.8 else f"{verb}_{noun}_{rng.choice(NOUNS)}"
    desc = rng.choice(DESCRIPTIONS).format(verb=verb, Verb=verb.capitalize(), noun=noun)
    return {
        "type": "function",
        "function": {"name": name, "description": desc, "parameters": random_object(rng, 1)},
    }


def random_object(rng: random.Random, depth: int) -> dict[str, Any]:
    num = rng.randint(1, 4 if depth == 1 else 3)
    names = rng.sample(PARAM_WORDS, num)
    props = {n: random_property(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or [names[0]]
    return {"type": "object", "properties": props, "required": required}


def random_property(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "string", "integer", "number", "boolean", "enum", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "array":
        item = rng.choice(["string", "integer"])
        schema: dict[str, Any] = {"type": "array", "items": {"type": item}}
        if rng.random() < 0.3:
            schema["maxItems"] = 4
        return schema
    if kind == "object":
        return random_object(rng, depth + 1)
    schema = {"type": kind}
    if rng.random() < 0.3:
        schema["description"] = f"The {rng.choice(NOUNS)} {kind} value."
    return schema


def random_value(rng: random.Random, schema: dict[str, Any]) -> Any:
    """A value that validates against the small schema subset generated above."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return " ".join(rng.sample(WORDS, rng.choice((1, 1, 1, 2))))
    if kind == "integer":
        return rng.choice((rng.randint(0, 20), rng.randint(0, 2000)))
    if kind == "number":
        return round(rng.uniform(0, 500), rng.choice((1, 2)))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        n = rng.randint(1, min(3, schema.get("maxItems", 3)))
        return [random_value(rng, schema["items"]) for _ in range(n)]
    if kind == "object":
        props = schema["properties"]
        keys = [k for k in props if k in schema["required"] or rng.random() < 0.5]
        return {k: random_value(rng, props[k]) for k in keys}
    raise ValueError(f"unknown schema type {kind!r}")


def spoken(value: Any) -> str:
    """How a user would write a value in a request."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(spoken(v) for v in value)
    if isinstance(value, dict):
        return "(" + ", ".join(f"{k} {spoken(v)}" for k, v in value.items()) + ")"
    return str(value)


def request_text(rng: random.Random, tool: dict[str, Any], args: dict[str, Any]) -> str:
    fn = tool["function"]
    verb, _, rest = fn["name"].partition("_")
    parts = [
        rng.choice(("{k} {v}", "{k}: {v}", "{k} = {v}", "{k} set to {v}")).format(
            k=k.replace("_", " ") if rng.random() < 0.3 else k, v=spoken(v)
        )
        for k, v in args.items()
    ]
    opener = rng.choice(
        (
            f"Please {verb} the {rest.replace('_', ' ')}",
            f"Can you {verb} a {rest.replace('_', ' ')}",
            f"I need to {verb} {rest.replace('_', ' ')}",
            f"{verb.capitalize()} {rest.replace('_', ' ')}",
            f"Use {fn['name']}",
        )
    )
    joiner = rng.choice((" with ", ", ", " using "))
    return opener + (joiner + ", ".join(parts) if parts else "") + rng.choice((".", "?", "", "!"))


def tool_call_conversation(rng: random.Random) -> dict[str, Any]:
    tools = [random_tool(rng) for _ in range(rng.randint(1, 4))]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        return tool_call_conversation(rng)
    messages: list[Message] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    if rng.random() < 0.08:  # a question that needs no tool
        doc = rng.choice(docstrings())
        messages += [
            {"role": "user", "content": f"Explain {doc.subject}."},
            {"role": "assistant", "content": doc.text},
        ]
        return {"kind": "tool_call", "tools": tools, "messages": messages}
    num_calls = rng.choices((1, 2, 3), weights=(6, 3, 1))[0]
    chosen = [rng.choice(tools) for _ in range(num_calls)]
    calls = [(t, random_value(rng, t["function"]["parameters"])) for t in chosen]
    request = " Also, ".join(request_text(rng, t, a) for t, a in calls)
    messages.append({"role": "user", "content": request})
    tool_calls = [{"name": t["function"]["name"], "arguments": a} for t, a in calls]
    messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
    results = []
    for call in tool_calls:
        result = {"status": rng.choice(("ok", "ok", "ok", "error")), "id": rng.randint(1, 9999)}
        if result["status"] == "ok":
            result[rng.choice(PARAM_WORDS)] = random_value(rng, {"type": "string"})
        messages.append({"role": "tool", "name": call["name"], "content": json.dumps(result)})
        results.append((call["name"], result))
    summary = " ".join(
        f"{name} returned status {r['status']} with id {r['id']}." for name, r in results
    )
    messages.append(
        {"role": "assistant", "content": rng.choice(("Done. ", "", "All set. ")) + summary}
    )
    return {"kind": "tool_call", "tools": tools, "messages": messages}


SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant with access to tools.",
    "You are an agent. Call tools when they help.",
    "You help users by calling the right function.",
)


# --- stdlib text and code -----------------------------------------------------------------------


@dataclass(frozen=True)
class Docstring:
    subject: str  # e.g. "the function shutil.copyfile"
    text: str


@dataclass(frozen=True)
class Function:
    summary: str  # first line of its docstring
    source: str


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo"}
    return sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))


@lru_cache(maxsize=1)
def _stdlib_index() -> tuple[list[Docstring], list[Function]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Docstring] = []
    funcs: list[Function] = []
    for path in stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            if isinstance(node, ast.Module):
                subject = f"the module {module}"
            else:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                subject = f"the {kind} {module}.{node.name}"
            if 120 <= len(doc) <= 1500:
                docs.append(Docstring(subject, doc.strip()))
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                if 3 <= node.end_lineno - node.lineno <= 20 and node.col_offset == 0:
                    segment = ast.get_source_segment(source, node)
                    summary = doc.strip().splitlines()[0].strip()
                    if segment and len(summary) > 15:
                        funcs.append(Function(summary, segment))
    return docs, funcs


def docstrings() -> list[Docstring]:
    return _stdlib_index()[0]


def functions() -> list[Function]:
    return _stdlib_index()[1]


def code_conversation(rng: random.Random) -> dict[str, Any]:
    fn = rng.choice(functions())
    ask = rng.choice(
        (
            "Write a Python function. {s}",
            "Implement this in Python: {s}",
            "Show code that does this: {s}",
        )
    )
    answer = f"```python\n{fn.source}\n```"
    if rng.random() < 0.5:
        answer = rng.choice(("Here is the function:\n\n", "Sure.\n\n", "")) + answer
    messages = [
        {"role": "user", "content": ask.format(s=fn.summary)},
        {"role": "assistant", "content": answer},
    ]
    return {"kind": "code", "tools": [], "messages": messages}


def prose_conversation(rng: random.Random) -> dict[str, Any]:
    doc = rng.choice(docstrings())
    ask = rng.choice(("Explain {s}.", "What does {s} do?", "Tell me about {s}.", "Describe {s}."))
    messages = [
        {"role": "user", "content": ask.format(s=doc.subject)},
        {"role": "assistant", "content": doc.text},
    ]
    return {"kind": "prose", "tools": [], "messages": messages}


# --- math ---------------------------------------------------------------------------------------


def math_conversation(rng: random.Random) -> dict[str, Any]:
    question, working, answer = rng.choice(MATH_PROBLEMS)(rng)
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"{working}\nThe answer is {answer}."},
    ]
    return {"kind": "math", "tools": [], "messages": messages}


def _buy(rng: random.Random) -> tuple[str, str, str]:
    who, item = rng.choice(FIRST_NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 9), rng.randint(2, 12)
    q = f"{who} has {a} {item} and buys {b} packs of {c} {item}. How many {item} does {who} have now?"  # noqa: E501
    w = f"{b} packs of {c} is {b} * {c} = {b * c}.\n{a} + {b * c} = {a + b * c}."
    return q, w, str(a + b * c)


def _share(rng: random.Random) -> tuple[str, str, str]:
    who, item = rng.choice(FIRST_NAMES), rng.choice(ITEMS)
    n, each, left = rng.randint(2, 9), rng.randint(2, 15), rng.randint(0, 8)
    total = n * each + left
    q = f"{who} shares {total} {item} equally among {n} friends. How many does each friend get, and how many are left?"  # noqa: E501
    w = f"{total} / {n} = {each} with remainder {left}, since {n} * {each} = {n * each} and {total} - {n * each} = {left}."  # noqa: E501
    return q, w, f"{each} each, with {left} left over"


def _price(rng: random.Random) -> tuple[str, str, str]:
    item = rng.choice(ITEMS)
    n, price, pay = rng.randint(2, 12), rng.randint(1, 25), 0
    cost = n * price
    pay = cost + rng.randint(0, 50)
    q = f"One box of {item} costs {price} dollars. How much change do you get from {pay} dollars after buying {n} boxes?"  # noqa: E501
    w = f"Cost: {n} * {price} = {cost} dollars.\nChange: {pay} - {cost} = {pay - cost} dollars."
    return q, w, f"{pay - cost} dollars"


def _speed(rng: random.Random) -> tuple[str, str, str]:
    speed, hours, extra = rng.randint(20, 120), rng.randint(2, 9), rng.randint(5, 90)
    d = speed * hours
    q = f"A train travels at {speed} km/h for {hours} hours, then {extra} km more. How far does it go in total?"  # noqa: E501
    w = f"Distance at speed: {speed} * {hours} = {d} km.\nTotal: {d} + {extra} = {d + extra} km."
    return q, w, f"{d + extra} km"


def _percent(rng: random.Random) -> tuple[str, str, str]:
    base, pct = rng.randint(2, 90) * 10, rng.choice((5, 10, 15, 20, 25, 30, 40, 50))
    off = base * pct // 100
    q = f"A jacket costs {base} dollars and is {pct}% off. What is the sale price?"
    w = f"Discount: {base} * {pct} / 100 = {off}.\nSale price: {base} - {off} = {base - off}."
    return q, w, f"{base - off} dollars"


def _arith(rng: random.Random) -> tuple[str, str, str]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    q = f"Compute ({a} + {b}) * {c}."
    w = f"{a} + {b} = {a + b}.\n{a + b} * {c} = {(a + b) * c}."
    return q, w, str((a + b) * c)


MATH_PROBLEMS = (_buy, _share, _price, _speed, _percent, _arith)
KINDS = {
    "tool_call": tool_call_conversation,
    "code": code_conversation,
    "math": math_conversation,
    "prose": prose_conversation,
}


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's messages as an agent sends them (``Runner``, OpenAI's API): a call as
    ``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``, each tool
    result with the id of its call; the corpus writes a call as ``{"name", "arguments"}``."""
    out, ids = [], []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            ids = [f"call_{len(out)}_{k}" for k in range(len(message["tool_calls"]))]
            calls = [{"id": i, "type": "function", "function": {
                "name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for i, c in zip(ids, message["tool_calls"], strict=True)]
            out.append({**message, "tool_calls": calls})
        elif message["role"] == "tool" and ids:
            out.append({**message, "tool_call_id": ids.pop(0)})
        else:
            out.append(message)
    return out


def generate(config: CorpusConfig) -> list[dict[str, Any]]:
    """All conversations of the corpus, in a seeded shuffled order."""
    rng = random.Random(config.seed)
    counts = {
        "tool_call": config.num_tool_call,
        "code": config.num_code,
        "math": config.num_math,
        "prose": config.num_prose,
    }
    convos = [KINDS[kind](rng) for kind, n in counts.items() for _ in range(n)]
    rng.shuffle(convos)
    return convos
