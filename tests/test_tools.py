"""``@tool`` schemas from signatures and docstrings, validation before the call, HTTP tools."""

import datetime
import enum
import functools
import itertools
import json
import math
import re
import sys
import textwrap
import threading
import time
import typing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Literal

import anyio
import pydantic
import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field, FiniteFloat

from agentflash.errors import UserError
from agentflash.runtime import Agent
from agentflash.runtime.tools import (
    HttpTool,
    ToolArgumentsError,
    parse_docstring,
    run_tool,
    tool,
    tool_spec,
)

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup


class Stay(BaseModel):
    nights: int
    breakfast: bool = False


calls: list[dict] = []


@tool
def book(city: str, guests: int, stay: Stay, kind: Literal["room", "suite"] = "room",
         note: str | None = None) -> dict:
    """Book a hotel.

    Args:
        city: Where to book.
        guests (int): How many people
            share the room.
        stay: Nights and breakfast.

    Returns:
        The booking.
    """
    calls.append({"city": city, "guests": guests, "stay": stay})
    return {"status": "ok", "city": city, "nights": stay.nights, "kind": kind}


def test_schema_comes_from_signature_hints_and_docstring():
    schema = book.parameters
    Draft202012Validator.check_schema(schema)
    assert book.description == "Book a hotel."
    assert schema["required"] == ["city", "guests", "stay"]
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["Stay"]["additionalProperties"] is False
    assert "title" not in _schema_keywords(schema)
    props = schema["properties"]
    assert props["city"] == {"type": "string", "description": "Where to book."}
    assert props["guests"]["description"] == "How many people share the room."
    assert props["kind"]["enum"] == ["room", "suite"] and props["kind"]["default"] == "room"
    assert tool_spec(book) == {"type": "function", "function": {
        "name": "book", "description": "Book a hotel.", "parameters": schema}}


def test_a_fields_own_description_wins_over_the_docstrings():
    from typing import Annotated

    from pydantic import Field

    def f(a: Annotated[int, Field(description="from Field")], b: int = Field(1, description="bee"),
          c: int = 0, d: int = Field(2, ge=1, le=14)) -> int:
        """F.

        Args:
            a: from the docstring
            b: docstring bee
            c: docstring cee
            d: docstring dee
        """
        return a

    props = tool(f).parameters["properties"]
    assert [props[k]["description"] for k in "abcd"] == ["from Field", "bee", "docstring cee",
                                                          "docstring dee"]
    assert (props["d"]["minimum"], props["d"]["maximum"], props["d"]["default"]) == (1, 14, 2)


def _schema_keywords(schema) -> set[str]:
    """Every keyword used anywhere in a schema (property names are not keywords)."""
    if isinstance(schema, list):
        return set().union(*map(_schema_keywords, schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    found = set(schema)
    for key, value in schema.items():
        if key in ("properties", "$defs"):
            found |= set().union(*map(_schema_keywords, value.values())) if value else set()
        else:
            found |= _schema_keywords(value)
    return found


def test_docstring_styles():
    numpy = """Sum two numbers.

    Parameters
    ----------
    a : int
        The first
        number.
    b : int
        The second.

    Returns
    -------
    int
    """
    assert parse_docstring(numpy) == ("Sum two numbers.", {"a": "The first number.",
                                                           "b": "The second."})
    sphinx = "Send a note.\n\n:param to: Recipient.\n:param str body: The text.\n:returns: id"
    assert parse_docstring(sphinx) == ("Send a note.", {"to": "Recipient.", "body": "The text."})
    wrapped = "Send.\n\n:param to: The one\n    who reads it.\n:param body: Text.\n:returns: id"
    assert parse_docstring(wrapped) == ("Send.", {"to": "The one who reads it.", "body": "Text."})
    google = "Find.\n\nArgs:\n    *names: Names.\n    limit (int, optional): At most this many.\n"
    assert parse_docstring(google)[1] == {"names": "Names.", "limit": "At most this many."}
    nested = "F.\n\nArgs:\n    a (int): first.\n    b (tuple(int, int)): second (a pair).\n"
    assert parse_docstring(nested)[1] == {"a": "first.", "b": "second (a pair)."}
    shared = "F.\n\nParameters\n----------\na, b : int\n    The bounds.\nc : str\n    C.\n"
    assert parse_docstring(shared)[1] == {"a": "The bounds.", "b": "The bounds.", "c": "C."}
    assert parse_docstring(None) == ("", {})


def test_arguments_are_validated_before_the_call():
    calls.clear()

    async def main():
        good = await run_tool(book, {"city": "Oslo", "guests": 2, "stay": {"nights": 3}})
        bad = await run_tool(book, {"city": "Oslo", "guests": "many", "stay": {}, "pets": 1})
        # what the schema refuses and lax validation would convert: "2" or true to 2
        loose = [await run_tool(book, {"city": "Oslo", "guests": guests, "stay": {"nights": 3}})
                 for guests in ("2", True)]
        # a key the nested model's schema refuses: pydantic dropped it, and the call ran
        nested = await run_tool(book, {"city": "Oslo", "guests": 2,
                                       "stay": {"nights": 3, "view": "sea"}})
        return good, bad, loose, nested

    good, bad, loose, nested = anyio.run(main)
    assert json.loads(nested.output)["error"] == ("invalid arguments for book: stay.view: "
                                                  "Extra inputs are not permitted")
    assert not good.is_error and json.loads(good.output) == {"status": "ok", "city": "Oslo",
                                                             "nights": 3, "kind": "room"}
    assert bad.is_error and len(calls) == 1  # the bad calls never reached the function
    assert [json.loads(o.output)["error"] for o in loose] == [
        "invalid arguments for book: guests: Input should be a valid integer"] * 2
    error = json.loads(bad.output)
    assert error["status"] == "error"
    for part in ("invalid arguments for book", "guests:", "stay.nights: Field required",
                 "pets: Extra inputs are not permitted"):
        assert part in error["error"]


def test_values_the_grammar_writes_pass_validation():
    # pydantic checks a float's multiple (below about 1e7: 10000000.04 is refused for 0.01,
    # which the grammar writes) and reads a pattern as the grammar does (Rust regex syntax;
    # jsonschema's float division and Python re refused 19.99 and \p{Lu})
    @tool
    def charge(price: Annotated[float, Field(multiple_of=0.01)],
               name: Annotated[str, Field(pattern=r"^\p{Lu}\w+$")],
               when: datetime.date, mode: Literal["a", "b"] = "a") -> str:
        return f"{price} {name} {when} {mode}"

    outcome = anyio.run(run_tool, charge, {"price": 19.99, "name": "Émile",
                                           "when": "2024-05-01"})
    assert not outcome.is_error and outcome.output == "19.99 Émile 2024-05-01 a"


def test_keys_of_a_pattern_are_declared():
    # a dict of integer keys is an object of patternProperties: its keys are the schema's own,
    # and a key its values' closed schema refuses is still found below them
    class Stay(BaseModel):
        nights: int

    @tool
    def rooms(names: dict[int, str], stays: dict[int, Stay]) -> str:
        return f"{names} {stays}"

    async def main():
        return [await run_tool(rooms, {"names": {"1": "bob"}, "stays": stays})
                for stays in ({"2": {"nights": 3}}, {"2": {"nights": 3, "view": "sea"}})]

    good, nested = anyio.run(main)
    assert not good.is_error and good.output == "{1: 'bob'} {2: Stay(nights=3)}"
    assert json.loads(nested.output)["error"] == ("invalid arguments for rooms: stays.2.view: "
                                                  "Extra inputs are not permitted")


def test_a_key_no_branch_of_a_union_of_models_takes_is_refused():
    """pydantic dropped it (a union of two models: neither branch alone was checked), and the
    call ran; a key the tagged branch refuses is refused where the other branch takes it."""
    class Cat(BaseModel):
        kind: Literal["cat"]
        meow: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        meow: int
        bark: int

    @tool
    def adopt(pet: Annotated[Cat | Dog, Field(discriminator="kind")], other: Cat | Dog) -> str:
        return f"{pet!r} {other!r}"

    cat, dog = {"kind": "cat", "meow": 1}, {"kind": "dog", "meow": 1, "bark": 2}

    async def main():
        return [await run_tool(adopt, {"pet": pet, "other": other}) for pet, other in (
            (cat, dog), ({**cat, "price": 9}, cat), (cat, {**dog, "price": 9}),
            ({**cat, "bark": 2}, cat), (cat, {**cat, "bark": 2}))]

    good, *bad = anyio.run(main)
    assert not good.is_error
    assert good.output == "Cat(kind='cat', meow=1) Dog(kind='dog', meow=1, bark=2)"
    assert [json.loads(o.output)["error"].removeprefix("invalid arguments for adopt: ")
            for o in bad] == [f"{key}: Extra inputs are not permitted" for key in (
                "pet.price", "other.price", "pet.bark", "other.bark")]


def test_sync_and_async_tools_errors_and_timeouts():
    @tool(timeout_s=0.2)
    async def slow(seconds: float) -> str:
        await anyio.sleep(seconds)
        return "done"

    @tool(name="blocking", timeout_s=0.2)
    def sleepy(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @tool
    def broken(x: int) -> int:
        raise ValueError(f"cannot handle {x}")

    @tool
    def raw(x: int) -> bytes:
        return b"\xff\xfe"  # not UTF-8: no text for the model

    @tool
    def cli(x: int) -> int:
        sys.exit(3)  # a command line's main() wrapped as a tool

    @tool
    async def async_cli(x: int) -> int:
        raise SystemExit("usage: async_cli X")

    @tool
    def counts(n: int):
        yield from range(n)

    @tool
    def stats(n: int) -> dict:
        return {"mean": float("nan"), "range": [float("-inf"), 1.5], "of": "caf\udce9.csv"}

    @tool
    def listing(n: int) -> str:
        return "files: caf\udce9.txt"  # a Latin-1 name read with surrogateescape

    @tool(timeout_s=0.2)
    async def ticks(n: int):
        for i in range(n):
            await anyio.sleep(0.05)
            yield {"tick": i}

    async def main():
        return [await run_tool(slow, {"seconds": 0}), await run_tool(slow, {"seconds": 5}),
                await run_tool(sleepy, {"seconds": 0}), await run_tool(sleepy, {"seconds": 1}),
                await run_tool(broken, {"x": 3}), await run_tool(raw, {"x": 1}),
                await run_tool(cli, {"x": 1}), await run_tool(async_cli, {"x": 1}),
                await run_tool(counts, {"n": 3}), await run_tool(ticks, {"n": 2}),
                await run_tool(ticks, {"n": 50}), await run_tool(stats, {"n": 1}),
                await run_tool(listing, {"n": 1})]

    (fast, late, fast_sync, late_sync, failed, unwritable, exited, async_exited, counted,
     ticked, late_ticks, no_number, listed) = anyio.run(main)
    # a byte that was not UTF-8 is U+FFFD for the model (no tokenizer takes a lone surrogate)
    assert listed.output == "files: caf\ufffd.txt"  # one for each
    # JSON has no NaN: the model read NaN and -Infinity, which no JSON parser reads (beside a
    # lone surrogate, which pydantic's JSON refused)
    assert json.loads(no_number.output) == {"mean": "NaN", "range": ["-Infinity", 1.5],
                                            "of": "caf\ufffd.csv"}
    # what a generator yields is its result, an async one's too (it was its repr), under the
    # timeout
    assert (counted.output, ticked.output) == ("[0, 1, 2]", '[{"tick": 0}, {"tick": 1}]')
    assert late_ticks.is_error and late_ticks.error_type == "timeout"
    # a tool's exit is its failure, for the model to read; the run and the process go on
    assert exited.is_error and "cli called exit(3)" in exited.output
    assert async_exited.is_error and "async_cli called exit('usage: async_cli X')" \
        in async_exited.output
    assert exited.error_type == async_exited.error_type == "SystemExit"
    assert unwritable.is_error and "raw returned a value that cannot be written as JSON: " \
        "UnicodeDecodeError" in unwritable.output
    assert (fast.output, fast.is_error) == ("done", False)
    assert late.is_error and "slow timed out after 0.2 s" in late.output and late.duration_s < 1
    assert (fast_sync.output, fast_sync.is_error) == ("done", False)
    assert late_sync.is_error and "blocking timed out" in late_sync.output
    assert failed.is_error and "ValueError: cannot handle 3" in failed.output
    assert sleepy.name == "blocking" and sleepy(0) == "done"  # still callable directly
    assert [o.error_type for o in (fast, late, late_sync, failed, unwritable)] == [
        None, "timeout", "timeout", "ValueError", "unserializable_result"]


def plain_wrapper(fn):
    """A decorator that hides what ``fn`` is (an async function, an async generator)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def test_sync_tools_see_the_callers_context_and_wrapped_async_tools_are_awaited():
    import contextvars

    user = contextvars.ContextVar("user", default="<unset>")

    @tool
    def whoami() -> str:
        return user.get()

    @tool
    @plain_wrapper
    async def doubled(n: int) -> int:
        await anyio.sleep(0)
        return 2 * n

    async def main():
        user.set("alice")
        return await run_tool(whoami, {}), await run_tool(doubled, {"n": 21})

    seen, twice = anyio.run(main)
    assert (seen.output, seen.is_error) == ("alice", False)
    assert (twice.output, twice.is_error) == ("42", False)


def test_a_sync_tool_past_its_timeout_holds_neither_the_run_nor_the_exit():
    release, ran_in = threading.Event(), []

    @tool(timeout_s=0.2)
    def stuck(x: int) -> str:
        ran_in.append(threading.current_thread())
        release.wait(10)
        return "late"

    outcome = anyio.run(run_tool, stuck, {"x": 1})
    assert outcome.is_error and "stuck timed out after 0.2 s" in outcome.output
    thread = ran_in[0]
    assert thread.is_alive() and thread.daemon  # the interpreter's exit does not join it
    release.set()
    thread.join(5)
    assert anyio.run(run_tool, stuck, {"x": 2}).output == "late"  # a prompt call still returns


def test_a_dataclass_tool_reads_the_names_of_its_own_body(tmp_path, monkeypatch):
    # its __init__'s hints, read with the module's names alone, did not find a nested Enum
    (tmp_path / "order_tool.py").write_text(textwrap.dedent("""\
        from __future__ import annotations
        import dataclasses, enum

        @dataclasses.dataclass
        class Order:
            \"\"\"Place an order.\"\"\"
            class Size(enum.Enum):
                S = "s"
                L = "l"
            size: Size
            qty: int = 1
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import order_tool

    made = tool(order_tool.Order)
    assert made.parameters["properties"]["size"] == {"$ref": "#/$defs/Size"}
    outcome = anyio.run(run_tool, made, {"size": "l"})
    assert not outcome.is_error and json.loads(outcome.output) == {"size": "l", "qty": 1}


def test_types_whose_schema_names_what_pydantic_refuses_are_refused_or_written_as_read():
    """An AliasPath field is shown by its name, which pydantic does not read; a Literal of a
    plain Enum's member is shown as its value, which pydantic refuses; a complex number was any
    string: every grammar-written value of them was refused."""
    import enum

    from pydantic import AliasChoices, AliasPath, ConfigDict

    class Plain(enum.Enum):
        RED = "red"

    class Text(str, enum.Enum):
        RED = "red"

    class Pathed(BaseModel):
        name: str = Field(validation_alias=AliasPath("names", 0))

    class ByName(Pathed):
        model_config = ConfigDict(validate_by_name=True)

    class Chosen(BaseModel):
        name: str = Field(validation_alias=AliasChoices("n", AliasPath("names", 0)))

    def pathed(who: Pathed) -> str:
        return who.name

    def plain(color: Literal[Plain.RED]) -> str:
        return "red"

    with pytest.raises(UserError, match=r"field 'name' is read from a path \(AliasPath"):
        tool(pathed)
    with pytest.raises(UserError, match="a Literal of enum members"):
        tool(plain)

    @tool
    def fine(a: ByName, b: Chosen, color: Literal[Text.RED], z: complex) -> str:
        return f"{a.name} {b.name} {color.value} {z}"

    arguments = {"a": {"name": "x"}, "b": {"n": "y"}, "color": "red", "z": "1.5-2j"}
    assert re.fullmatch(fine.parameters["properties"]["z"]["pattern"], arguments["z"])
    outcome = anyio.run(run_tool, fine, arguments)
    assert not outcome.is_error and outcome.output == "x y red (1.5-2j)"
    for bad in ("j", "1+j", "abc"):
        assert not re.fullmatch(fine.parameters["properties"]["z"]["pattern"], bad)


def test_bad_tool_definitions_are_user_errors():
    def untyped(city):
        return city

    def star(*cities: str):
        return cities

    with pytest.raises(UserError, match="parameter 'city' has no type hint"):
        tool(untyped)
    def keywords(city: str, **options: str):
        return city

    with pytest.raises(UserError, match=r"cannot take \*cities \(nor"):
        tool(star)
    with pytest.raises(UserError, match=r"cannot take \*\*options \(nor"):
        tool(keywords)
    with pytest.raises(UserError, match="tool name 'two words'"):
        tool(name="two words")(lambda x: x)
    with pytest.raises(UserError, match="tool name '' must be"):  # was the function's name
        tool(name="")(lambda x: x)
    with pytest.raises(UserError, match="timeout_s must be a positive number"):
        tool(timeout_s=0)(star)
    # a builtin of C has no signature: a ValueError's traceback out of validate and run
    with pytest.raises(UserError, match=r"max: its signature cannot be read \(no signature"):
        tool(max)

    class Booking:  # a class: its __init__'s hints (the class's own named none of them)
        """Book a room."""

        def __init__(self, city: str, nights: int = 1):
            self.city, self.nights = city, nights

    made = tool(Booking)
    assert made.parameters["properties"] == {"city": {"type": "string"},
                                             "nights": {"type": "integer", "default": 1}}
    assert made.description == "Book a room."

    class Limit:  # __init__'s hint, not the class's own of that name
        """Set a limit."""
        limit: typing.ClassVar[int] = 10
        query: list[str] = []

        def __init__(self, limit: int, query: str):
            self.value = limit

    assert tool(Limit).parameters["properties"] == {"limit": {"type": "integer"},
                                                    "query": {"type": "string"}}

    class Place(BaseModel):  # pydantic's own __init__(**data: Any) names no field "data"
        """Place it."""
        data: int
        city: str

    assert tool(Place).parameters["properties"] == {"data": {"type": "integer"},
                                                    "city": {"type": "string"}}

    class Thing:  # not a type pydantic can describe
        pass

    def takes(thing: Thing) -> str:
        return "x"

    with pytest.raises(UserError, match="takes: parameter 'thing': pydantic cannot describe it: "
                                        "Unable to generate pydantic-core schema for") as err:
        tool(takes)
    assert "\n" not in str(err.value)  # pydantic's paragraphs of advice are left out
    # and its advice to set arbitrary_types_allowed: a tool has no model_config, and the type
    # would still have no JSON Schema for the model to write
    assert "arbitrary_types_allowed" not in str(err.value)
    assert str(err.value).endswith("give it a type pydantic describes (str, int, a list, a model)")

    def search(query: str, on_result: typing.Callable[[str], None], page: int = 1) -> list:
        """Search."""
        return []

    with pytest.raises(UserError, match=r"^[^:]*search: parameter 'on_result': pydantic cannot "
                                        r"describe it: Cannot generate a JsonSchema for "
                                        r"core_schema.CallableSchema; a tool's arguments"):
        tool(search)  # the parameter was named by none ("pydantic cannot describe the parameters")

    def pick(ids: set[int]) -> str:  # uniqueItems: no grammar binds a call to it
        return "x"

    with pytest.raises(UserError, match=r"pick parameters: #/properties/ids: uniqueItems is not "
                                        r"supported \(a set's or frozenset's schema; a false "
                                        r"one asks nothing: leave it out\).*use a list"):
        tool(pick)  # (in llguidance's words: 'Unimplemented keys: ["uniqueItems"]')
    with pytest.raises(UserError, match="has no __name__; give the tool one"):
        tool(functools.partial(pick))

    def parsed(count: int, ids: list[pydantic.Json[int]]) -> str:  # strings pydantic parses:
        return "x"  # the schema says string, so the grammar would write "hello"

    with pytest.raises(UserError, match=r"parsed: parameter 'ids': a pydantic.Json\[...\]"):
        tool(parsed)
    with pytest.raises(UserError, match="timeout_s must be a positive number, got True"):
        tool(timeout_s=True)(star)

    def configured(model_config: int) -> int:  # pydantic would read it as its settings
        return model_config

    with pytest.raises(UserError, match="parameter 'model_config' is a name pydantic keeps"):
        tool(configured)

    for name in ("__doc__", "__module__", "_x"):  # __doc__: an AttributeError; __module__:
        namespace: dict = {}  # create_model took it as its own, and the tool took no argument
        exec(f"def private({name}: int) -> int:\n    return 1", namespace)
        with pytest.raises(UserError, match=f"parameter '{name}' begins with an underscore"):
            tool(namespace["private"])

    from pydantic import constr

    def looks_ahead(code: constr(pattern=r"^(?=.*\d)[a-z0-9]+$")) -> str:  # pydantic's own
        return code  # regex engine refuses it as the schema is made: named, not raised raw

    with pytest.raises(UserError, match="looks_ahead: parameter 'code': pydantic cannot describe "
                                        "it: error: look-around, including look-ahead"):
        tool(looks_ahead)  # the SchemaError's cause, its last line (the first: "Error building")

    def shadows(model_dump: int) -> int:  # a BaseModel member
        return model_dump

    with pytest.raises(UserError, match="shadows: parameter 'model_dump': pydantic cannot "
                                        "describe it: Field 'model_dump' conflicts"):
        tool(shadows)

    def named_like_properties(model_extra: int, model_fields_set: int = 7) -> str:
        return f"{model_extra} {model_fields_set}"  # BaseModel's properties: pydantic allows

    called = anyio.run(run_tool, tool(named_like_properties), {"model_extra": 42})
    assert called.output == "42 7"


def test_a_method_decorated_in_its_class_is_refused_as_unbound_naming_what_works():
    # "parameter 'self' has no type hint" invited a hint, which put self into the schema
    with pytest.raises(UserError) as err:
        class Weather:
            @tool
            def get(self, city: str) -> str:
                return city
    assert str(err.value) == (
        "test_a_method_decorated_in_its_class_is_refused_as_unbound_naming_what_works.<locals>"
        ".Weather.get: is an unbound method (its first parameter 'self' is no argument a model "
        "can give): pass the bound method instead (obj.get of an instance obj = Weather(...), "
        "as tool(obj.get) or Agent(tools=[...])), or make it a @staticmethod without self")

    class Forecast:  # self with a hint too (which put it into the schema)
        def __init__(self, days: int):
            self.days = days

        def get(self: object, city: str) -> str:
            return f"{city} {self.days}"

        def make(cls, city: str) -> str:
            return city

        @classmethod
        def of(cls, city: str) -> str:
            return city

        @staticmethod
        def plain(city: str) -> str:
            return city

    for method, first in ((Forecast.get, "self"), (Forecast.make, "cls")):
        with pytest.raises(UserError, match=f"is an unbound method .*first parameter '{first}'"):
            tool(method)
    with pytest.raises(UserError, match=r"\(Forecast\.make of a @classmethod, as tool\("):
        tool(Forecast.make)
    # what the message names works: the bound method, a classmethod's, a staticmethod
    obj = Forecast(3)
    for made in (tool(obj.get), tool(Forecast.of), tool(Forecast.plain)):
        assert list(made.parameters["properties"]) == ["city"]
    assert anyio.run(run_tool, tool(obj.get), {"city": "Oslo"}).output == "Oslo 3"
    (given,) = Agent(name="a", tools=[obj.get]).tools
    assert list(given.parameters["properties"]) == ["city"]

    class Cities:
        @tool
        @staticmethod
        def count(city: str) -> int:
            return len(city)

    assert list(Cities.count.parameters["properties"]) == ["city"]
    # @tool over @classmethod said "@tool needs a function, got classmethod"
    with pytest.raises(UserError) as err:
        class Towns:
            @tool
            @classmethod
            def count(cls, town: str) -> int:
                return len(town)
    assert str(err.value).endswith(
        ".Towns.count: @tool over @classmethod would make the tool before its class exists: "
        "keep the @classmethod alone and make the tool with tool(Towns.count) after the class")

    def self_named(self: int) -> int:  # a function's own parameter named self: no method
        return self

    assert list(tool(self_named).parameters["properties"]) == ["self"]


def test_a_first_self_or_cls_hinted_other_than_its_class_is_a_parameter():
    # a staticmethod's cls: int (a class label) was refused as an unbound method
    class Vision:
        @staticmethod
        def describe(cls: int) -> str:
            return str(cls)

        @staticmethod
        def rename(self: str, to: str) -> str:
            return f"{self} {to}"

        def own(self: "Vision", x: int) -> int:
            return x

        def own_type(cls: "type[Vision]", x: int) -> int:
            return x

        def typed(cls: type["Vision"], x: int) -> int:
            return x

        def any_self(self: "typing.Self", x: int) -> int:
            return x

    for made, names in ((tool(Vision.describe), ["cls"]), (tool(Vision().describe), ["cls"]),
                        (tool(Vision.rename), ["self", "to"])):
        assert list(made.parameters["properties"]) == names
    assert made.parameters["properties"]["self"] == {"type": "string"}
    assert anyio.run(run_tool, tool(Vision.describe), {"cls": 7}).output == "7"
    for method, first in ((Vision.own, "self"), (Vision.own_type, "cls"),
                          (Vision.typed, "cls"), (Vision.any_self, "self")):
        with pytest.raises(UserError, match=f"is an unbound method .*first parameter '{first}'"):
            tool(method)



def test_a_first_self_or_cls_hinted_as_any_value_but_its_owner_is_a_parameter():
    # only scalars, Literals, Enums and their Optionals were read as values: a staticmethod's
    # cls: list[str], a date, a NewType, a model, Union[int, str] were refused as unbound
    UserId = typing.NewType("UserId", int)

    class Point(BaseModel):
        x: int

    class Box:
        @staticmethod
        def names(cls: list[str], city: str) -> str:
            return f"{len(cls)} {city}"

        @staticmethod
        def counts(cls: dict[str, int], city: str) -> str:
            return city

        @staticmethod
        def day(self: datetime.date, city: str) -> str:
            return f"{self.isoformat()} {city}"

        @staticmethod
        def user(cls: UserId, city: str) -> str:
            return city

        @staticmethod
        def point(cls: Point, city: str) -> str:
            return city

        @staticmethod
        def either(cls: typing.Union[int, str], city: str) -> str:  # noqa: UP007
            return city

        @staticmethod
        def raw(cls: bytes, city: str) -> str:
            return city

        def some(self: type, city: str) -> str:
            return city

        def owned(self: "typing.Union[Box, int]", city: str) -> str:  # noqa: UP007
            return city

        def mine(self, city: str) -> str:
            return city

    Box.mine.__annotations__["self"] = typing.Optional[Box]  # noqa: UP045  (resolved: itself)
    for method in (Box.names, Box.counts, Box.day, Box.user, Box.point, Box.either, Box.raw):
        assert list(tool(method).parameters["properties"])[1:] == ["city"]
    assert anyio.run(run_tool, tool(Box.day), {"self": "2024-05-01", "city": "Oslo"}).output \
        == "2024-05-01 Oslo"
    assert anyio.run(run_tool, tool(Box.names), {"cls": ["a", "b"], "city": "Oslo"}).output \
        == "2 Oslo"
    for method in (Box.some, Box.owned, Box.mine):
        with pytest.raises(UserError, match="is an unbound method .*first parameter 'self'"):
            tool(method)

def test_a_first_self_or_cls_is_a_parameter_only_hinted_as_a_value_a_model_gives():
    # self: W (a TypeVar bound to the class), "Weather[T]", Any, a Protocol, "Optional[Box]"
    # were read as parameters: pydantic failed on them, or self was {} in the schema
    W = typing.TypeVar("W", bound="Weather")
    T = typing.TypeVar("T")

    class Named(typing.Protocol):
        name: str

    class Unit(enum.Enum):
        C = "C"

    class Weather(typing.Generic[T]):
        def copy(self: W, city: str) -> str:
            return city

        def get(self: "Weather[T]", city: str) -> str:
            return city

        def loose(self: typing.Any, city: str) -> str:
            return city

        def named(self: Named, city: str) -> str:
            return city

        def maybe(self: "typing.Optional[Weather]", city: str) -> str:  # noqa: UP045
            return city

        @staticmethod
        def label(cls: "int | None", city: str) -> str:
            return f"{cls} {city}"

        @staticmethod
        def unit(self: Unit, city: str) -> str:
            return f"{self.value} {city}"

        @staticmethod
        def kind(cls: typing.Optional[Literal["a", "b"]], city: str) -> str:  # noqa: UP045
            return f"{cls} {city}"

    for method in (Weather.copy, Weather.get, Weather.loose, Weather.named, Weather.maybe):
        with pytest.raises(UserError, match="is an unbound method .*first parameter 'self'"):
            tool(method)
    for method, first in ((Weather.label, "cls"), (Weather.unit, "self"),
                          (Weather.kind, "cls")):
        assert list(tool(method).parameters["properties"]) == [first, "city"]
    assert anyio.run(run_tool, tool(Weather.unit), {"self": "C", "city": "Oslo"}).output \
        == "C Oslo"


def test_the_schema_binds_what_pydantic_checks_and_arguments_are_read_as_json():
    """The grammar writes whatever a tool's schema allows, so where pydantic's JSON validation
    is stricter than its schema the schema says so (a Decimal as a string is a number; a dict's
    integer keys are integers); and arguments are validated as the JSON they are (a strict
    model takes a date, an enum, a UUID, a tuple from JSON's strings and arrays)."""
    import datetime
    import decimal
    import enum
    import uuid as uuid_module

    from jsonschema import Draft202012Validator
    from pydantic import ConfigDict

    def pay(amount: decimal.Decimal, counts: dict[int, str]) -> str:
        return f"{amount} {counts}"

    schema = tool(pay).parameters
    check = Draft202012Validator(schema)
    assert check.is_valid({"amount": "12.50", "counts": {"3": "x", "-1": "y"}})
    # a number is read through a float (0.1000000000000000055 is 0.1; 1e400 infinity): a string
    for bad in ({"amount": "river", "counts": {}}, {"amount": "1", "counts": {"status": "x"}},
                {"amount": 12.5, "counts": {}}, {"amount": "1E+400", "counts": {}}):
        assert not check.is_valid(bad), bad

    class Color(enum.Enum):
        RED = "red"

    class Event(BaseModel):
        model_config = ConfigDict(strict=True)
        when: datetime.date
        color: Color
        id: uuid_module.UUID
        pair: tuple[int, str]

    got = []

    def book(event: Event) -> str:
        got.append(event)
        return "ok"

    arguments = {"event": {"when": "2026-12-01", "color": "red",
                           "id": "12345678-1234-5678-1234-567812345678", "pair": [1, "a"]}}
    outcome = anyio.run(run_tool, tool(book), arguments)
    assert not outcome.is_error, outcome.output
    assert got[0].when == datetime.date(2026, 12, 1) and got[0].color is Color.RED
    assert got[0].pair == (1, "a")


def test_dates_times_and_durations_the_grammar_writes_are_ones_pydantic_reads(
        demo_tokenizer_dir):
    """JSON Schema's formats allow what pydantic refuses (a leap second, year 0000, February 29
    of any year, a duration of any size): random outputs under a tool's grammar, with a bias
    towards those, validate as its arguments."""
    import datetime
    import random

    import numpy as np
    from transformers import AutoTokenizer

    from agentflash.grammar import compile_grammar, json_schema
    from agentflash.grammar.bench import closing_tokens, random_output

    class When(BaseModel):
        day: datetime.date
        at: datetime.time
        stamp: datetime.datetime
        span: datetime.timedelta

    def book(when: When) -> str:
        return "ok"

    booked = tool(book)
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    grammar = compile_grammar(json_schema(booked.parameters), tok, vocab_size=len(tok))
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    # the digits that make the values pydantic refuses, and the closers, preferred
    edges = np.array([any(d in (piece or "") for d in ("60", "00", "29", "9")) for piece in vocab])
    rng, refused, finished = random.Random(0), [], 0
    for _ in range(60):
        tokens = random_output(grammar.new_constraint(), closing_tokens(tok, len(tok)) | edges,
                               rng)
        if tokens[-1] != tok.eos_token_id:  # ran out of tokens (a duration's digits go on)
            continue
        finished += 1
        arguments = json.loads(tok.decode(tokens[:-1]))
        try:
            When.model_validate_json(json.dumps(arguments["when"]))
        except ValueError as err:
            refused.append((arguments, str(err).splitlines()[1]))
    assert not refused, refused[:3]
    assert finished >= 40


def test_decimals_urls_and_naive_or_aware_datetimes_the_grammar_writes_are_ones_pydantic_reads(
        demo_tokenizer_dir):
    """pydantic's schemas allow a Decimal of any digits (and 1e400, infinity), an HttpUrl of any
    scheme and a datetime with an offset only, where pydantic refuses the one and a naive
    datetime the other: random outputs under a tool's grammar, biased to digits, all validate
    as its arguments, and a naive and an aware datetime are both reachable."""
    import datetime
    import decimal
    import random
    from typing import Annotated

    import numpy as np
    import pydantic
    from pydantic import Field
    from transformers import AutoTokenizer

    from agentflash.grammar import compile_grammar, json_schema
    from agentflash.grammar.bench import closing_tokens, random_output

    class Order(BaseModel):
        any_amount: decimal.Decimal
        price: Annotated[decimal.Decimal, Field(max_digits=4, decimal_places=2)]
        fee: Annotated[decimal.Decimal, Field(max_digits=3)]
        tip: Annotated[decimal.Decimal, Field(ge=0, le=50, max_digits=3)]
        step: Annotated[decimal.Decimal, Field(multiple_of=decimal.Decimal("0.25"),
                                               decimal_places=1)]
        local: pydantic.NaiveDatetime
        utc: pydantic.AwareDatetime
        stamp: datetime.datetime
        site: pydantic.HttpUrl

    def place(order: Order) -> str:
        return "ok"

    placed = tool(place)
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    grammar = compile_grammar(json_schema(placed.parameters), tok, vocab_size=len(tok))
    digits = np.array([any(ch.isdigit() for ch in (piece or ""))
                       for piece in tok.convert_ids_to_tokens(list(range(len(tok))))])
    rng, refused, stamps = random.Random(0), [], []
    for _ in range(60):
        tokens = random_output(grammar.new_constraint(), closing_tokens(tok, len(tok)) | digits,
                               rng, max_tokens=600)
        if tokens[-1] != tok.eos_token_id:
            continue
        arguments = json.loads(tok.decode(tokens[:-1]))
        try:
            stamps.append(Order.model_validate_json(json.dumps(arguments["order"])).stamp)
        except ValueError as err:
            refused.append((arguments, str(err).splitlines()[1:3]))
    assert not refused, refused[:3]
    assert len(stamps) >= 15  # the others ran out of tokens (a URL's path goes on)
    assert {stamp.tzinfo is None for stamp in stamps} == {True, False}


def test_keys_and_formats_the_grammar_writes_are_ones_pydantic_reads(demo_tokenizer_dir):
    """pydantic names a dict's keys of an enum, a literal, a UUID or a date in propertyNames
    (which llguidance lacks), leaves keys of a pattern or a bool open, and names formats
    llguidance lacks (uuid4, path, binary, password, ipvanyaddress): the tool's grammar compiles,
    and random outputs under it are arguments the tool takes."""
    import dataclasses
    import datetime
    import enum
    import ipaddress
    import pathlib
    import random
    import uuid as uuid_module

    import pydantic
    from pydantic import constr
    from transformers import AutoTokenizer

    from agentflash.grammar import compile_grammar, json_schema
    from agentflash.grammar.bench import closing_tokens, random_output

    class Color(enum.Enum):
        RED = "red"
        DARK_BLUE = "dark.blue"

    @dataclasses.dataclass
    class Note:
        text: str
        stamp: int = dataclasses.field(init=False, default=7)  # takes no value

    got: list[tuple] = []

    @tool
    def tag(colors: dict[Color, int], sizes: dict[Literal["s", "m"], int],
            ids: dict[uuid_module.UUID, bool], days: dict[datetime.date, str],
            flags: dict[bool, int], codes: dict[constr(pattern=r"^[a-z]$"), int],
            key: pydantic.UUID4, default: pathlib.Path, blob: bytes, secret: pydantic.SecretStr,
            host: pydantic.IPvAnyAddress, note: Note, format: str) -> str:
        # (parameters named as schema keywords: the walk over formats took "format" for one)
        got.append((colors, key, default, blob, host, note))
        return "ok"

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    grammar = compile_grammar(json_schema(tag.parameters), tok, vocab_size=len(tok))
    rng, refused, finished = random.Random(0), [], 0
    for _ in range(30):
        tokens = random_output(grammar.new_constraint(), closing_tokens(tok, len(tok)), rng,
                               max_tokens=800)
        if tokens[-1] != tok.eos_token_id:
            continue
        finished += 1
        outcome = anyio.run(run_tool, tag, json.loads(tok.decode(tokens[:-1])))
        if outcome.is_error:
            refused.append(outcome.output)
    assert not refused, refused[:3]
    assert finished >= 10 and len(got) == finished
    colors, key, path, blob, host, note = got[0]
    assert all(isinstance(c, Color) for c in colors) and key.version == 4
    assert isinstance(path, pathlib.Path) and isinstance(blob, bytes)
    assert isinstance(host, (ipaddress.IPv4Address, ipaddress.IPv6Address)) and note.stamp == 7
    assert "stamp" not in tag.parameters["$defs"]["Note"]["properties"]


def test_dict_keys_the_schema_allows_are_ones_pydantic_reads():
    """Keys of Decimal were left open (pydantic names a pattern but leaves the object open),
    keys of Literal[1, 2] too (pydantic reads no key "1" as 1), and the bounds of int and
    float keys were dropped: keys the grammar wrote were refused."""
    import decimal

    @tool
    def keyed(prices: dict[decimal.Decimal, str], some: dict[Literal["a", 1], int],
              ages: dict[Annotated[int, Field(ge=0)], str],
              debts: dict[Annotated[int, Field(lt=0)], str]) -> str:
        return "ok"

    validator = Draft202012Validator(keyed.parameters)
    given = {"prices": {"1.5": "x"}, "some": {"a": 1}, "ages": {"0": "x"}, "debts": {"-3": "x"}}
    assert validator.is_valid(given)
    assert anyio.run(run_tool, keyed, given).output == "ok"
    for name, key in (("prices", "cheap"), ("some", "1"), ("ages", "-1"), ("debts", "0")):
        assert not validator.is_valid({**given, name: {key: 1 if name == "some" else "x"}})

    def numbered(counts: dict[Literal[1, 2], str]) -> str:
        return "no"

    def small(m: dict[Annotated[int, Field(ge=1, le=5)], str]) -> str:
        return "no"

    def below(m: dict[Annotated[float, Field(lt=1)], str]) -> str:
        return "no"

    def positive(m: dict[Annotated[decimal.Decimal, Field(gt=0)], str]) -> str:
        return "no"

    with pytest.raises(UserError, match=r"parameter 'counts': a dict's keys of \[1, 2\]"):
        tool(numbered)

    @tool  # finite floats: the keys' pattern writes no inf or nan (it was refused as a bound)
    def finite(m: dict[FiniteFloat, str]) -> str:
        return "ok"

    assert anyio.run(run_tool, finite, {"m": {"1.5": "x"}}).output == "ok"
    for fn, bounds in ((small, "ge=1, le=5"), (below, "lt=1"), (positive, "gt=0")):
        with pytest.raises(UserError, match=rf"parameter 'm': a dict's keys .*\({bounds}\)"):
            tool(fn)


def test_keys_of_an_int_enum_or_a_bounded_str_are_ones_pydantic_reads(demo_tokenizer_dir):
    """pydantic names a dict's keys of an IntEnum, or of a str of a length, in propertyNames,
    which llguidance refused ("Unimplemented keys"): their pattern, and every key the grammar
    writes is one pydantic reads."""
    import enum
    import random

    from pydantic import StringConstraints, TypeAdapter
    from transformers import AutoTokenizer

    from agentflash.grammar import compile_grammar, json_schema
    from agentflash.grammar.bench import closing_tokens, random_output

    class Level(enum.IntEnum):
        LOW = 1
        HIGH = 20

    Short = Annotated[str, StringConstraints(max_length=3)]
    Middle = Annotated[str, StringConstraints(min_length=2, max_length=4)]
    Long = Annotated[str, StringConstraints(min_length=3)]
    got = []

    @tool
    def keyed(levels: dict[Level, int], short: dict[Short, int], middle: dict[Middle, int],
              long: dict[Long, int]) -> str:
        got.append(levels)
        return "ok"

    # the schema takes a key of a bounded str where pydantic does, of any characters
    validator = Draft202012Validator(keyed.parameters)
    for hint, name in ((Short, "short"), (Middle, "middle"), (Long, "long")):
        for key in ("", "a", "ab", "abc", "abcd", "abcde", "\n\t", "é😀", " " * 3, "a\nb\nc"):
            given = {"levels": {}, "short": {}, "middle": {}, "long": {}, name: {key: 1}}
            try:
                TypeAdapter(dict[hint, int]).validate_json(json.dumps({key: 1}), strict=True)
                read = True
            except pydantic.ValidationError:
                read = False
            assert validator.is_valid(given) == read, (name, key)
    assert not validator.is_valid({"levels": {"3": 1}, "short": {}, "middle": {}, "long": {}})
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    grammar = compile_grammar(json_schema(keyed.parameters), tok, vocab_size=len(tok))
    rng, refused, lengths = random.Random(0), [], set()
    for _ in range(60):
        tokens = random_output(grammar.new_constraint(), closing_tokens(tok, len(tok)), rng,
                               max_tokens=300)
        if tokens[-1] != tok.eos_token_id:
            continue
        arguments = json.loads(tok.decode(tokens[:-1]))
        lengths |= {(name, len(key)) for name in ("short", "middle") for key in arguments[name]}
        outcome = anyio.run(run_tool, keyed, arguments)
        if outcome.is_error:
            refused.append(outcome.output)
    assert not refused, refused[:3]
    assert len(got) >= 20 and any(got) and all(isinstance(k, Level) for g in got for k in g)
    assert {("short", 3), ("middle", 4)} <= lengths, lengths  # up to their bounds

    # a pattern and a length: no one key pattern holds both; a length pydantic counts once it
    # has stripped the key: "  " is no key of one character
    def both(m: dict[Annotated[str, StringConstraints(min_length=2, pattern="^[a-z]+$")],
                     int]) -> str:
        return "no"

    def stripped(m: dict[Annotated[str, StringConstraints(min_length=1,
                                                          strip_whitespace=True)], int]) -> str:
        return "no"

    with pytest.raises(UserError, match=r"parameter 'm': .*min_length=2, pattern='\^\[a-z\]\+\$'"
                                         r"\).* write the length into the pattern"):
        tool(both)
    with pytest.raises(UserError, match=r"parameter 'm': .*drop strip_whitespace or the "
                                         r"min_length"):
        tool(stripped)


def test_keys_of_a_length_and_a_case_are_counted_as_pydantic_counts_them():
    """pydantic counts a key before it changes its case ("ß" is one character, "SS" once
    read): keys of a length and to_lower or to_upper were refused with a false reason. Only a
    least length of stripped keys lets the pattern take a key pydantic refuses ("  ")."""
    from pydantic import StringConstraints, TypeAdapter

    samples = ["", "a", "ab", "abc", "ß", "İ", "ßß", "İİ", "ﬃ", "Σσ", " ", "  ", " a", "a ",
               " a ", "\t", "\u00a0", "\u3000x", "é😀", "a\nb"]
    for lengths in ({"max_length": 1}, {"max_length": 2}, {"min_length": 2},
                    {"min_length": 1, "max_length": 2}, {"min_length": 0, "max_length": 1}):
        for change in ({"to_lower": True}, {"to_upper": True}, {"strip_whitespace": True},
                       {"strip_whitespace": True, "to_upper": True}):
            key = Annotated[str, StringConstraints(**lengths, **change)]

            def keyed(m: dict[key, int]) -> str:
                return "ok"

            if lengths.get("min_length") and change.get("strip_whitespace"):
                with pytest.raises(UserError, match=r"parameter 'm': .*counted by pydantic once "
                                                    r"it has stripped their whitespace"):
                    tool(keyed)
                continue
            validator = Draft202012Validator(tool(keyed).parameters)
            for text in samples:
                try:
                    TypeAdapter(dict[key, int]).validate_json(json.dumps({text: 1}), strict=True)
                    read = True
                except pydantic.ValidationError:
                    read = False
                taken = validator.is_valid({"m": {text: 1}})
                # what the schema takes pydantic reads; with no stripping, just that
                assert taken <= read and (taken == read or "strip_whitespace" in change), (
                    lengths, change, text, taken, read)


def test_keys_are_bound_by_their_model_s_str_settings_too():
    """A model's ConfigDict(str_...) binds its dicts' str keys as a key's own constraints do
    (its own first): the grammar wrote keys pydantic refused ("  " of min_length=1 once
    stripped), and str_max_length=2 failed in llguidance ("Unimplemented keys:
    propertyNames")."""
    from pydantic import ConfigDict, StringConstraints

    class Tags(BaseModel):
        model_config = ConfigDict(str_strip_whitespace=True)
        m: dict[Annotated[str, StringConstraints(min_length=1)], int]

    def label(t: Tags) -> str:
        return "ok"

    with pytest.raises(UserError, match=r"parameter 't': .*counted by pydantic once it has "
                                        r"stripped their whitespace"):
        tool(label)
    samples = ["", "a", "ab", "abc", "abcd", "abcde", "ß", "ßß", " ", "  ", " a ", "AB"]
    for config in ({"str_max_length": 2}, {"str_min_length": 2, "str_max_length": 3},
                   {"str_max_length": 1, "str_to_upper": True},
                   {"str_max_length": 2, "str_strip_whitespace": True}):

        class Short(BaseModel):
            model_config = ConfigDict(**config)
            m: dict[str, int] = {}
            own: dict[Annotated[str, StringConstraints(max_length=4)], int] = {}

        def short(s: Short) -> str:
            return "ok"

        made = tool(short)
        validator = Draft202012Validator(made.parameters)
        for field in ("m", "own"):
            for text in samples:
                try:
                    Short.model_validate_json(json.dumps({field: {text: 1}}), strict=True)
                    read = True
                except pydantic.ValidationError:
                    read = False
                taken = validator.is_valid({"s": {field: {text: 1}}})
                assert taken <= read and (taken == read or "str_strip_whitespace" in config), (
                    config, field, text, taken, read)
        assert not validator.is_valid({"s": {"m": {"abcd": 1}}})
        assert validator.is_valid({"s": {"own": {"abcd": 1}}})  # its own max_length first


def test_a_literal_or_enum_of_bytes_is_refused_naming_the_parameter():
    """Literal[b"a"] as a dict's key failed in json.dumps ("Object of type bytes is not JSON
    serializable"); as a parameter its schema was the string "a", which pydantic refuses in
    every mode: every call the grammar wrote failed."""
    import enum

    from pydantic import TypeAdapter

    class Raw(enum.Enum):
        A = b"a"

    for hint in (Literal[b"a"], Raw, Literal["x", b"a"]):  # (its "x" pydantic reads)
        with pytest.raises(pydantic.ValidationError):
            TypeAdapter(hint).validate_json('"a"', strict=False)

    def key(m: dict[Literal[b"a"], int]) -> str:
        return "no"

    def value(m: Literal["x", b"a"]) -> str:
        return "no"

    def member(m: list[Raw]) -> str:
        return "no"

    for fn, what in ((key, "a Literal"), (value, "a Literal"), (member, "the Enum Raw")):
        with pytest.raises(UserError) as caught:
            tool(fn)
        assert str(caught.value) == (
            f"{fn.__qualname__}: parameter 'm': {what} holds bytes (b'a'), which pydantic reads "
            f"from no JSON value (no string is bytes there): take str values ('a')")


def test_an_integer_past_a_float_is_refused_where_a_float_is_read():
    """pydantic reads 1 and 400 zeros as infinity for a float (JSON's grammar and llguidance's
    allow it, and the call's JSON keeps it an int): the tool was called with inf."""
    from pydantic import TypeAdapter

    big = 10**400
    assert TypeAdapter(float).validate_json(str(big), strict=True) == math.inf
    got = []

    class Point(BaseModel):
        y: float
        z: float = 1.0

    @tool
    def place(x: float, point: Point, count: int, weights: tuple[float, ...] = ()) -> str:
        got.append((x, point, count, weights))
        return "ok"

    base = {"x": 1, "point": {"y": 2}, "count": 3}
    for where, arguments in (("x", {**base, "x": big}), ("point.y", {**base, "point": {"y": -big}}),
                             ("weights.1", {**base, "weights": [1, big]})):
        outcome = anyio.run(run_tool, place, arguments)
        assert outcome.is_error and outcome.error_type == "invalid_arguments"
        assert json.loads(outcome.output)["error"] == (
            f"invalid arguments for place: {where}: the integer of 401 digits is past a float's "
            f"range (read as a float, it is infinity)")
    assert got == []
    assert anyio.run(run_tool, place, {**base, "count": big}).output == "ok"  # an int's own
    assert anyio.run(run_tool, place, {**base, "x": 10**308}).output == "ok"  # within a float's
    assert got[0][2] == big and got[1][0] == 1e308


def test_an_integer_past_a_float_is_judged_where_it_was_given():
    """Any huge integer beside any infinity was refused (an int's 10**400 beside a dataclass
    whose default is inf, the int named): each is judged by whether the infinities are fewer
    with it 0 (through fields, aliases, keys, indexes, a key pydantic changed)."""
    import dataclasses

    big = 10**400
    got = []

    @dataclasses.dataclass
    class Budget:
        currency: str = "EUR"
        max_price: float = dataclasses.field(default_factory=lambda: math.inf)  # no limit

    class Limits(BaseModel):
        low: float = Field(alias="from")
        rest: dict[int, float] = {}
        lower: dict[Annotated[str, pydantic.StringConstraints(to_lower=True)], float] = {}
        cap: float = Field(default_factory=lambda: math.inf)

    @tool
    def count(n: int, budget: Budget, limits: Limits | None = None) -> str:
        got.append((n, budget, limits))
        return "ok"

    for arguments in ({"n": big, "budget": {}}, {"n": big, "budget": {"currency": "USD"}},
                      {"n": 5, "budget": {}, "limits": {"from": 1, "rest": {"2": 3}}}):
        assert anyio.run(run_tool, count, arguments).output == "ok"
    assert got[0][0] == big and got[0][1].max_price == math.inf
    for arguments, where in (
            ({"n": big, "budget": {"max_price": big}}, ["budget.max_price"]),
            ({"n": big, "budget": {}, "limits": {"from": -big}}, ["limits.from"]),
            ({"n": 1, "budget": {}, "limits": {"from": 1, "rest": {"2": big}}}, ["limits.rest.2"]),
            ({"n": 1, "budget": {}, "limits": {"from": 1, "lower": {"A": big}}},
             ["limits.lower.A"]),
            ({"n": big, "budget": {}, "limits": {"from": big, "lower": {"B": -big}}},
             ["limits.from", "limits.lower.B"])):
        _refused_as_infinity(count, arguments, where)
    assert len(got) == 3


def _refused_as_infinity(fn, arguments: dict, where: list[str]) -> None:
    """``fn`` called with ``arguments`` is refused, naming the integers at ``where`` as read
    past a float's range."""
    outcome = anyio.run(run_tool, fn, arguments)
    assert outcome.is_error and outcome.error_type == "invalid_arguments"
    assert json.loads(outcome.output)["error"] == f"invalid arguments for {fn.name}: " + "; ".join(
        f"{path}: the integer of 401 digits is past a float's range (read as a float, it is "
        f"infinity)" for path in where)


def test_a_first_cls_hinted_as_a_model_of_another_module_named_as_its_class_is_a_parameter():
    """The owner was told by its qualified name alone: a staticmethod of a class Order whose
    cls is a model Order of another module (imported as OrderIn) was refused as unbound."""
    import types

    schemas = types.ModuleType("agentflash_test_schemas")
    exec("from pydantic import BaseModel\nclass Order(BaseModel):\n    item: str\n"
         "    qty: int\n", schemas.__dict__)
    shop = {"OrderIn": schemas.Order, "__name__": "agentflash_test_shop"}
    exec("class Order:\n    @staticmethod\n    def price(cls: OrderIn, currency: str) -> str:\n"
         "        return f'{cls.qty} x {cls.item} in {currency}'\n"
         "    def total(self: 'Order', currency: str) -> str:\n        return currency\n", shop)
    sys.modules[schemas.__name__] = schemas
    try:
        price = tool(shop["Order"].price)
        assert list(price.parameters["properties"]) == ["cls", "currency"]
        assert anyio.run(run_tool, price, {"cls": {"item": "pen", "qty": 2},
                                           "currency": "EUR"}).output == "2 x pen in EUR"
        with pytest.raises(UserError, match="is an unbound method"):
            tool(shop["Order"].total)  # its own class, by the same name
    finally:
        del sys.modules[schemas.__name__]


def test_an_integer_past_a_float_is_named_where_a_validator_scales_it_or_the_edge_is_refused():
    """Replaced by the float's edge alone, an integer a validator scales (km to m: the edge is
    inf again) or one whose field refuses the edge (multiple_of 0.5) was not named, and the
    tool got inf: small values (1, 0) are tried too."""
    big = 10**400
    got = []

    @tool
    def drive(km: Annotated[float, pydantic.AfterValidator(lambda v: v * 1000)]) -> str:
        got.append(km)
        return "ok"

    @tool
    def step(x: Annotated[float, Field(multiple_of=0.5)] = 0.5) -> str:
        got.append(x)
        return "ok"

    for fn, arguments, where in ((drive, {"km": big}, "km"), (drive, {"km": -big}, "km"),
                                 (step, {"x": big}, "x")):
        outcome = anyio.run(run_tool, fn, arguments)
        assert outcome.is_error and outcome.error_type == "invalid_arguments", outcome.output
        assert f"{where}: the integer of 401 digits is past a float's range" in outcome.output
    assert anyio.run(run_tool, drive, {"km": 2}).output == "ok" and got == [2000.0]


def test_an_integer_past_a_float_is_found_where_validators_move_it():
    """Following the call's paths into the validated value missed what validators move (a
    model validator swapping two fields, a key's AfterValidator: the tool got inf), a deque's
    items, and refused a dataclass's Annotated alias field (an int) beside a default inf. Where
    no integer alone makes the infinity (the greatest of two), all of them are named."""
    import collections
    import dataclasses

    big = 10**400
    got = []

    class Range(BaseModel):
        low: float
        high: float

        @pydantic.model_validator(mode="after")
        def ordered(self):
            if self.low > self.high:
                self.low, self.high = self.high, self.low
            return self

    @dataclasses.dataclass
    class Budget:
        max_price: float = dataclasses.field(default_factory=lambda: math.inf)
        count: Annotated[int, Field(alias="n")] = 0

    Tag = Annotated[str, pydantic.AfterValidator(lambda k: "tag_" + k)]
    Top = Annotated[tuple[float, ...], pydantic.AfterValidator(lambda xs: (max(xs, default=0),))]

    @tool
    def search(price: Range | None = None, tags: dict[Tag, float] | None = None,
               queue: collections.deque[float] | None = None, budget: Budget | None = None,
               top: Top = (),
               above: Annotated[float, Field(gt=1)] = 2) -> str:
        got.append((price, tags, queue, budget, top, above))
        return "ok"

    for arguments, where in (({"price": {"low": big, "high": 1}}, ["price.low"]),
                             ({"tags": {"x": 1, "tag_x": big}}, ["tags.tag_x"]),
                             ({"queue": [1, big]}, ["queue.1"]),
                             ({"top": [big, 1, big]}, ["top.0", "top.2"]),  # all at once
                             ({"above": big}, ["above"])):
        outcome = anyio.run(run_tool, search, arguments)
        assert outcome.is_error and outcome.error_type == "invalid_arguments"
        assert json.loads(outcome.output)["error"] == "invalid arguments for search: " + "; ".join(
            f"{path}: the integer of 401 digits is past a float's range (read as a float, it is "
            f"infinity)" for path in where)
    assert got == []
    assert anyio.run(run_tool, search, {"budget": {"n": big}}).output == "ok"
    assert got[0][3].count == big and got[0][3].max_price == math.inf



def test_a_huge_integer_whose_zero_is_refused_is_not_read_as_infinity():
    """A huge integer was judged by replacing it with 0, and a refusal then counted as guilt: a
    PositiveInt's 10**400 beside a default inf was named "read as infinity" and a valid call
    refused. It is replaced by the integer of its sign at a float's edge instead."""
    import dataclasses

    big = 10**400
    got = []

    @dataclasses.dataclass
    class Budget:
        n: pydantic.PositiveInt = 1
        limit: float = dataclasses.field(default_factory=lambda: math.inf)

    @tool
    def plan(b: Budget, n: pydantic.PositiveInt = 1,
             low: Annotated[float, Field(lt=0)] = -1.0, x: float = 0) -> str:
        got.append((b, n, low, x))
        return "ok"

    assert anyio.run(run_tool, plan, {"b": {"n": big}}).output == "ok"
    assert anyio.run(run_tool, plan, {"b": {}, "n": big}).output == "ok"
    assert got[0][0].n == big and got[0][0].limit == math.inf and got[1][1] == big
    for arguments, where in (({"b": {"n": big}, "n": big, "x": big}, ["x"]),
                             ({"b": {}, "low": -big}, ["low"])):  # its sign kept: -edge < 0
        _refused_as_infinity(plan, arguments, where)
    assert len(got) == 2


def test_bytes_of_a_max_length_are_written_in_ascii():
    """pydantic counts a bytes value's UTF-8 bytes, the grammar its characters: "ééé" (six
    bytes) passed a max_length of 3 in the schema and was refused."""
    from agentflash.runtime.agent import output_spec

    @tool
    def store(blob: Annotated[bytes, Field(max_length=3)],
              body: Annotated[bytes, Field(min_length=2)]) -> str:
        return "ok"

    validator = Draft202012Validator(store.parameters)
    assert validator.is_valid({"blob": "a\nb", "body": "éé"})  # at least 2 bytes: so is "éé"
    assert not validator.is_valid({"blob": "ééé", "body": "ab"})
    assert anyio.run(run_tool, store, {"blob": "a\nb", "body": "éé"}).output == "ok"
    schema = output_spec(Annotated[bytes, Field(max_length=2)]).schema
    assert not Draft202012Validator(schema).is_valid("é")


def test_bytes_a_model_reads_as_base64_or_hex_are_written_so(demo_tokenizer_dir):
    """Under val_json_bytes="base64" (or "hex") pydantic decodes a bytes value, and counts the
    bytes it decodes to: the grammar wrote any string ("Data should be valid base64"), and
    ser_json_bytes="base64" named a format llguidance refused (base64url)."""
    import itertools
    import random

    from pydantic import ConfigDict
    from transformers import AutoTokenizer

    from agentflash.grammar import compile_grammar, json_schema
    from agentflash.grammar.bench import closing_tokens, random_output

    class Upload(BaseModel):
        model_config = ConfigDict(val_json_bytes="base64", ser_json_bytes="base64")
        data: bytes
        tag: Annotated[bytes, Field(min_length=2, max_length=4)]
        parts: dict[Annotated[bytes, Field(min_length=1, max_length=1)], int] = {}  # keys too

    class Digest(BaseModel):
        model_config = ConfigDict(val_json_bytes="hex")
        sha: Annotated[bytes, Field(max_length=3)]

    got = []

    @tool
    def put(upload: Upload, digest: Digest, raw: bytes) -> str:
        got.append((upload, digest, raw))
        return "ok"

    # the schema takes a string (or a key) where pydantic reads it: every string of up to 3
    # symbols of both alphabets, padding and others, and some longer ones
    validator = Draft202012Validator(put.parameters)

    def agree(data="", tag="YWJj", sha="", parts=None):
        arguments = {"upload": {"data": data, "tag": tag, "parts": parts or {}},
                     "digest": {"sha": sha}, "raw": "x"}
        try:
            put.params_model.model_validate_json(json.dumps(arguments), strict=True)
            read = True
        except pydantic.ValidationError:
            read = False
        assert validator.is_valid(arguments) == read, arguments

    symbols = "AQYgw+/-_=é "
    strings = ["".join(s) for n in range(4) for s in itertools.product(symbols, repeat=n)]
    strings += ["YWJj", "YWJjYQ", "YWJjYQ=", "YWJjYQ==", "YWJjYQ===", "YWI=", "YWI==", "-_8=",
                "+/8=", "+_8=", "YR==", "YWJjZGVm", "YWJjZGVmZw=="]
    for text in strings:
        agree(data=text)
        agree(tag=text)
        agree(parts={text: 1})
    for text in ("0a", "0A", "a", "0g", "0a0b0c", "0a0b0c0d"):
        agree(sha=text)
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    grammar = compile_grammar(json_schema(put.parameters), tok, vocab_size=len(tok))
    rng, refused = random.Random(0), []
    for _ in range(60):
        tokens = random_output(grammar.new_constraint(), closing_tokens(tok, len(tok)), rng,
                               max_tokens=300)
        if tokens[-1] != tok.eos_token_id:
            continue
        outcome = anyio.run(run_tool, put, json.loads(tok.decode(tokens[:-1])))
        if outcome.is_error:
            refused.append(outcome.output)
    assert not refused, refused[:3]
    assert len(got) >= 20 and any(upload.data for upload, _, _ in got)
    assert any(upload.parts for upload, _, _ in got)
    assert all(2 <= len(upload.tag) <= 4 and len(digest.sha) <= 3 for upload, digest, _ in got)


def test_a_bounded_date_the_grammar_writes_is_within_its_bounds(demo_tokenizer_dir):
    """pydantic checks a date's bounds and names them in no schema: the grammar wrote any day,
    and a call the model could only write again was refused."""
    import datetime
    import random
    from typing import Annotated

    from transformers import AutoTokenizer

    from agentflash.grammar import compile_grammar, json_schema
    from agentflash.grammar.bench import closing_tokens, random_output

    got: list[tuple[datetime.date, datetime.date]] = []

    @tool
    def book(start: Annotated[datetime.date, Field(ge=datetime.date(2025, 1, 30),
                                                   le=datetime.date(2025, 3, 1))],
             end: Annotated[datetime.date, Field(gt="2024-12-31",  # as pydantic reads it
                                                 lt=datetime.date(2025, 1, 3))]) -> str:
        got.append((start, end))
        return "ok"

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    grammar = compile_grammar(json_schema(book.parameters), tok, vocab_size=len(tok))
    rng, refused = random.Random(0), []
    for _ in range(40):
        tokens = random_output(grammar.new_constraint(), closing_tokens(tok, len(tok)), rng)
        outcome = anyio.run(run_tool, book, json.loads(tok.decode(tokens[:-1])))
        if outcome.is_error:
            refused.append(outcome.output)
    assert not refused, refused[:3]
    assert {end for _, end in got} == {datetime.date(2025, 1, d) for d in (1, 2)}
    assert len({start.month for start, _ in got}) == 3  # January 30 to March 1

    def never(day: Annotated[datetime.date, Field(gt=datetime.date(2025, 1, 1),
                                                  lt=datetime.date(2025, 1, 2))]) -> str:
        return "no"

    with pytest.raises(UserError, match=r"no date lies within its bounds"):
        tool(never)


def test_every_number_a_bounded_decimals_schema_allows_is_one_pydantic_reads():
    """Places past max_digits add no digits (0.123 has 3): the number branches of a bounded
    Decimal stay within its digits, as its string pattern does."""
    import decimal
    from typing import Annotated

    import pydantic
    from pydantic import Field

    for digits, places, bounds in ((2, 3, {"ge": 0}), (3, 1, {"ge": 0}), (2, 2, {"ge": 0}),
                                   (2, 2, {"le": 0.5}), (1, 0, {"gt": -5}),
                                   (2, 2, {"gt": 0, "le": 0.5})):
        kind = Annotated[decimal.Decimal,
                         Field(max_digits=digits, decimal_places=places, **bounds)]

        def f(x: kind) -> str:  # noqa: B023
            return "ok"

        schema, reader = tool(f).parameters["properties"]["x"], pydantic.TypeAdapter(kind)
        allowed = 0
        for branch in schema.get("anyOf", [schema]):
            step = decimal.Decimal(str(branch["multipleOf"]))
            top = decimal.Decimal(str(branch["exclusiveMaximum"]))
            assert step > 0 and top <= 10 ** digits
            for n in range(-int(top / step), int(top / step) + 1):
                x = step * n
                if (x < top and x > decimal.Decimal(str(branch["exclusiveMinimum"]))
                        and x >= decimal.Decimal(str(branch.get("minimum", -math.inf)))
                        and x <= decimal.Decimal(str(branch.get("maximum", math.inf)))):
                    reader.validate_json(format(x.normalize(), "f"))  # raises if it refuses
                    allowed += 1
        assert allowed >= 5, (digits, places, bounds)


def test_usual_urls_fit_a_url_parameter_and_pydantic_reads_every_url_its_pattern_allows(
        demo_tokenizer_dir):
    """A URL parameter's pattern takes what tools are given every day (an IP address, a port
    past 9999, IPv6, a file path) and nothing pydantic refuses: URLs built from good and bad
    parts (a user and password among them, which the pattern leaves out), and IPv6 hosts
    checked against the ipaddress module."""
    import ipaddress
    import random
    import re

    import pydantic
    from transformers import AutoTokenizer

    from agentflash.grammar import compile_grammar, json_schema
    from agentflash.json_formats import _ipv6, url_pattern

    def fetch(site: pydantic.HttpUrl, path: pydantic.FileUrl, cache: pydantic.RedisDsn) -> str:
        return "ok"

    usual = {"site": ["http://127.0.0.1:8000/", "http://localhost:11434/api",
                      "https://[2001:db8::8a2e:370:7334]/", "http://[::1]:8080/x?y=1#z",
                      "https://api.example.com/v1/items?id=3"],
             "path": ["file:///etc/hosts", "file://host/share/a.txt"],
             "cache": ["redis://localhost:6379/0", "rediss://10.0.0.7:6380"]}
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    grammar = compile_grammar(json_schema(tool(fetch).parameters), tok, vocab_size=len(tok))
    for i in range(2):
        arguments = {key: urls[i] for key, urls in usual.items()}
        tokens = tok(json.dumps(arguments), add_special_tokens=False)["input_ids"]
        constraint = grammar.new_constraint()
        assert constraint.validate_draft(tokens) == len(tokens), arguments

    rng, r6 = random.Random(0), re.compile(_ipv6())
    for _ in range(20_000):
        parts = [rng.choice(["", "0", "1", "ffff", "abcd", "12345", "g", "1.2.3.4", "256.0.0.1"])
                 for _ in range(rng.randint(0, 9))]
        text = rng.choice(["", "::"]) + ":".join(parts) + rng.choice(["", "::"])
        try:
            ipaddress.IPv6Address(text)
            valid = True
        except ValueError:
            valid = False
        assert bool(r6.fullmatch(text)) == valid, text
    hosts = ["example.com", "localhost", "127.0.0.1", "256.1.1.1", "01.2.3.4", "[::1]", "[::1",
             "[::ffff:1.2.3.4]", "-a.com", "a.1com", "xn--e1a.com", "1.2.3", "", "[g::1]", "x.y."]
    users = ["", "u:p@", "u:@", ":p@", "a%20b:c@", "u:p:q@", "@", "u p@"]
    ports = ["", ":0", ":8080", ":65535", ":65536", ":", ":1a"]
    for kind, schemes in ((pydantic.HttpUrl, ["http", "https"]), (pydantic.FileUrl, ["file"]),
                          (pydantic.RedisDsn, ["redis", "rediss"])):
        pattern, reader = re.compile(url_pattern(schemes)), pydantic.TypeAdapter(kind)
        for host, user, port, path in itertools.product(hosts, users, ports,
                                                         ["", "/a/b?x=1#f", "/a b"]):
            url = f"{schemes[0]}://{user}{host}{port}{path}"
            if pattern.fullmatch(url):
                reader.validate_python(url)  # raises where pydantic refuses it


def test_field_defaults_partials_and_callable_objects_make_tools():
    from pydantic import Field

    def weather(city: str, days: int = Field(1, ge=1, description="Days ahead."),
                unit: str = "c") -> str:
        """Weather.

        Args:
            city: The city.
        """
        return f"{city} {days} {unit}"

    class Lookup:
        def __call__(self, key: str, json: bool = False) -> str:  # json: a name BaseModel has
            """Look up a key."""
            return key.upper()

    fahrenheit = tool(name="weather_f")(functools.partial(weather, unit="f"))
    days = fahrenheit.parameters["properties"]["days"]
    assert days == {"type": "integer", "description": "Days ahead.", "default": 1, "minimum": 1}
    assert fahrenheit.description == "Weather."
    assert fahrenheit.parameters["properties"]["unit"]["default"] == "f"
    lookup = tool(name="lookup")(Lookup())
    assert lookup.description == "Look up a key." and lookup.parameters["required"] == ["key"]

    async def main():
        return [await run_tool(fahrenheit, {"city": "Oslo"}),
                await run_tool(fahrenheit, {"city": "Oslo", "days": 0}),
                await run_tool(lookup, {"key": "a", "json": True})]

    default, too_few, called = anyio.run(main)
    assert (default.output, default.is_error) == ("Oslo 1 f", False)
    assert too_few.error_type == "invalid_arguments" and "days" in too_few.output
    assert (called.output, called.is_error) == ("A", False)


class _Documented:
    def run(self, x: int) -> int:
        """Run it."""
        return x

    @staticmethod
    def scale(x: int) -> int:
        """Scale it."""
        return x


class _Overriding(_Documented):  # its undocumented methods read the ones they override
    def run(self, x: int) -> int:
        return x

    @staticmethod
    def scale(x: int) -> int:
        return x


class _Calculator:  # of the module, where inspect.getdoc found object's __call__ for it
    """Evaluate an arithmetic expression.

    Args:
        expr: The expression, like 2+3*4.
    """

    def __call__(self, expr: str) -> float:
        return 0.0


class _Bare:
    def __call__(self, x: int) -> int:
        return x


def test_a_tools_description_is_a_docstring_the_user_wrote():
    """inspect.getdoc walked the class hierarchy up to Python's and pydantic's own classes: a
    callable object documented on its class was described "Call self as a function." (object's
    __call__), a model without a docstring by pydantic's BaseModel docs, a dataclass and a
    NamedTuple by the text made of their fields ("DC(x: int)", "NT(x,)")."""
    import dataclasses

    class Lookup(BaseModel):
        key: str

    class Documented(BaseModel):
        """Look it up."""
        key: str

    @dataclasses.dataclass
    class DC:
        x: int

        def __call__(self, y: int) -> int:
            return y

    @dataclasses.dataclass
    class Written:
        """Write it."""
        x: int

    class NT(typing.NamedTuple):
        x: int

    class Pair(typing.NamedTuple):
        x: int
        y: str

    calc = tool(name="calc")(_Calculator())
    assert calc.description == "Evaluate an arithmetic expression."
    assert calc.parameters["properties"]["expr"]["description"] == "The expression, like 2+3*4."
    assert tool(name="calc")(functools.partial(_Calculator())).description == calc.description
    for undocumented in (_Bare(), _Bare().__call__, Lookup, DC, DC(1), NT, Pair):
        assert tool(name="t")(undocumented).description == "", undocumented
    assert [tool(c).description for c in (Documented, Written)] == ["Look it up.", "Write it."]

    def f(x: int) -> int:
        """F it."""
        return x

    # functions, partials, bound methods and staticmethods read theirs as before
    made = [f, functools.partial(f), _Documented().run, _Overriding().run, _Documented.scale,
            _Overriding.scale]
    assert [tool(name="t")(m).description for m in made] == [
        "F it.", "F it.", "Run it.", "Run it.", "Scale it.", "Scale it."]


def test_a_tools_description_is_read_off_the_classes_that_define_its_method():
    """The walk up a callable object's classes read ``vars(c).get("__call__").__doc__`` of every
    class, None's where a class defines none: a string from Python 3.13 on ("The type of the
    None singleton."); and a class whose ``__module__`` is None raised an AttributeError."""
    class Base:
        def __call__(self, x: int) -> int:
            """Call the base."""
            return x

    class Mixin:
        pass

    class Nameless:
        pass

    Nameless.__module__ = None  # as some class factories leave it

    class Inherits(Mixin, Base):
        pass

    class Odd(Nameless, Base):
        pass

    assert tool(name="t")(Inherits()).description == "Call the base."
    assert tool(name="t")(Odd()).description == "Call the base."


class _Later(BaseModel):
    x: "_NotDefinedAnywhere"  # noqa: F821


def test_a_parameter_whose_model_is_not_fully_defined_is_named_with_the_tools_model():
    def fwd(q: str, m: _Later) -> str:
        """Fwd."""
        return q

    # the probe of each parameter alone was a model named "parameter": pydantic's words then
    # named a model the user never saw
    with pytest.raises(UserError, match=r"fwd: parameter 'm': pydantic cannot describe it: "
                                        r"`fwd_arguments` is not fully defined"):
        tool(fwd)


def test_a_default_that_is_no_value_of_its_type_is_refused_when_the_tool_is_made():
    from typing import Annotated, Literal

    from pydantic import Field

    # a call that left the parameter out handed the function the default its schema refuses
    def bad(a: int = "x") -> int:
        """Bad."""
        return a

    def below(a: Annotated[int, Field(ge=0)] = -1) -> int:
        """Below its bound."""
        return a

    def unlisted(unit: Literal["c", "f"] = "k") -> str:
        """Not a choice."""
        return unit

    for fn, message in ((bad, "its default 'x' is not a value of its type: Input should be a "
                              "valid integer"),
                        (below, "its default -1 is not a value of its type: Input should be "
                                "greater than or equal to 0"),
                        (unlisted, "its default 'k' is not a value of its type")):
        with pytest.raises(UserError, match=f"{fn.__qualname__}: parameter ") as err:
            tool(fn)
        assert message in str(err.value)

    # None (an optional parameter in Python's old spelling), a factory, a value pydantic reads
    def fine(a: int = None, b: list[int] = Field(default_factory=list), c: float = 1,  # noqa: RUF013
             d: int = "3") -> int:
        """Fine."""
        return 0

    assert tool(fine).parameters["properties"]["c"]["default"] == 1

    # a validator of the parameter's own, for what the model writes ("L2"), is not asked of
    # the default it is already parsed into (its AttributeError escaped)
    from pydantic import BeforeValidator

    def level_of(value: str) -> int:
        return int(value.removeprefix("L"))

    def search(level: Annotated[int, BeforeValidator(level_of, json_schema_input_type=str)] = 2
               ) -> int:
        """Search at a level."""
        return level

    assert tool(search).parameters["properties"]["level"]["default"] == 2


# --- HTTP tools against a real server on loopback -----------------------------------------------


class Recorder(BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):
        Recorder.seen.append(("GET", self.path, None))
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/elsewhere")
            self.end_headers()
            return
        if self.path.startswith("/missing"):
            return self._reply(404, "text/plain", b"no such thing")
        if self.path.startswith("/slow"):
            time.sleep(1)
        if self.path.startswith("/huge"):  # 3 MiB of text
            return self._reply(200, "text/plain", b"x" * (3 << 20))
        if self.path.startswith("/latin"):  # text in the charset its header names
            return self._reply(200, "text/plain; charset=iso-8859-1", "café".encode("latin-1"))
        if self.path.startswith("/bom"):  # JSON after a byte-order mark
            return self._reply(200, "application/json", b'\xef\xbb\xbf{"ok": 1}')
        self._reply(200, "application/json", json.dumps({"path": self.path}).encode())

    def do_DELETE(self):
        Recorder.seen.append(("DELETE", self.path, None))
        if self.path.startswith("/broken"):  # says JSON, is not
            return self._reply(200, "application/json", b"<html>oops</html>")
        self._reply(204, "application/json", b"")  # done, nothing to say

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recorder.seen.append(("POST", self.path, body))
        self._reply(200, "text/plain", f"got {sorted(body)}".encode())

    def _reply(self, status, kind, data):
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


PARAMS = {"type": "object", "properties": {"to": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "direct": {"type": "boolean"}},
          "required": ["to"], "additionalProperties": False}


def test_http_tool_calls_only_its_declared_url(server_url):
    Recorder.seen.clear()
    get = HttpTool("search", "Find flights.", "GET", f"{server_url}/flights", PARAMS)
    post = HttpTool("order", "Order.", "POST", f"{server_url}/orders", PARAMS)
    redirect = HttpTool("hop", "", "GET", f"{server_url}/redirect", PARAMS)
    missing = HttpTool("gone", "", "GET", f"{server_url}/missing", PARAMS)
    slow = HttpTool("slow", "", "GET", f"{server_url}/slow", PARAMS, timeout_s=0.3)
    versioned = HttpTool("v2", "", "GET", f"{server_url}/flights?api_version=2", PARAMS)
    # a query of its own, sent as written (httpx's params re-encoded it: ?acl=, sig=a+b)
    signed = HttpTool("signed", "", "GET", f"{server_url}/flights?acl&sig=a%20b;c", PARAMS)
    bare = HttpTool("bare", "", "GET", f"{server_url}/flights?acl&sig=a%20b;c")  # no arguments
    ends = HttpTool("ends", "", "GET", f"{server_url}/flights?v=1&", PARAMS)  # its own joiner
    amp = HttpTool("amp", "", "GET", f"{server_url}/r&d&", PARAMS)  # an & of the path, no query
    secret = HttpTool("secret", "", "GET",
                      server_url.replace("://", "://user:hunter2@") + "/missing?key=SECRET")

    async def main():
        tricky = {"to": "Oslo/../admin?x=1", "tags": ["a", "b"], "direct": True}
        return [await run_tool(versioned, {"to": "Rome"}), await run_tool(get, tricky),
                await run_tool(signed, {"to": "Rome"}), await run_tool(bare, {}),
                await run_tool(ends, {"to": "Rome", "tags": []}),
                await run_tool(amp, {"to": "Rome"}),
                await run_tool(secret, {}),
                await run_tool(post, {"to": "Rome", "direct": False}),
                await run_tool(get, {"to": 3}),
                await run_tool(redirect, {"to": "x"}),
                await run_tool(missing, {"to": "x"}),
                await run_tool(slow, {"to": "x"})]

    kept, ok, signed_to, signed_alone, ended, amped, hidden, posted, invalid, hopped, gone, \
        late = anyio.run(main)
    assert json.loads(ended.output)["path"] == "/flights?v=1&to=Rome"  # no "&&", no "tags="
    assert json.loads(amped.output)["path"] == "/r&d&?to=Rome"
    # the declared URL's own query stays; the arguments join it
    assert json.loads(kept.output)["path"] == "/flights?api_version=2&to=Rome"
    assert json.loads(signed_to.output)["path"] == "/flights?acl&sig=a%20b;c&to=Rome"
    assert json.loads(signed_alone.output)["path"] == "/flights?acl&sig=a%20b;c"
    # the model, or a remote server, reads the error: no password or query key in it
    assert hidden.is_error and "HTTP 404 from http://127.0.0.1:" in hidden.output
    assert "hunter2" not in hidden.output and "SECRET" not in hidden.output
    assert not ok.is_error
    path = json.loads(ok.output)["path"]
    assert path.startswith("/flights?") and "to=Oslo%2F..%2Fadmin%3Fx%3D1" in path
    assert "tags=a&tags=b" in path and "direct=true" in path
    assert posted.output == "got ['direct', 'to']"
    assert invalid.is_error and "to: 3 is not of type 'string'" in invalid.output
    assert hopped.is_error and "HTTP 302" in hopped.output
    assert gone.is_error and "HTTP 404" in gone.output and "no such thing" in gone.output
    assert late.is_error and "timed out" in late.output.lower()
    paths = [p.split("?")[0] for _, p, _ in Recorder.seen]
    assert "/elsewhere" not in paths and len([p for p in paths if p == "/flights"]) == 5


def test_http_tool_reads_a_reply_up_to_its_cap(server_url):
    # a reply was read whole into memory, however large, then into the prompt
    huge = HttpTool("huge", "", "GET", f"{server_url}/huge", PARAMS)
    latin = HttpTool("latin", "", "GET", f"{server_url}/latin", PARAMS)
    bom = HttpTool("bom", "", "GET", f"{server_url}/bom", PARAMS)

    async def main():
        return [await run_tool(t, {"to": "x"}) for t in (huge, latin, bom)]

    big, text, marked = anyio.run(main)
    assert big.is_error and "HTTP 200 from" in big.output and "larger than 1 MiB" in big.output
    assert not text.is_error and text.output == "café"
    assert json.loads(marked.output) == {"ok": 1}


def test_http_tool_checks_arguments_as_the_grammar_writes_them(server_url):
    """Arguments the grammar would not write (a key the schema does not list, a date that is no
    date) never reach the server, nor does one replacing the declared URL's own query; an empty
    JSON reply is a result, not a failure."""
    Recorder.seen.clear()
    params = {"type": "object", "properties": {"q": {"type": "string"},
                                               "when": {"type": "string", "format": "date"},
                                               "at": {"type": "string", "format": "time"}}}
    search = HttpTool("search", "", "GET", f"{server_url}/find?api_key=SECRET", params)
    anything = HttpTool("any", "", "GET", f"{server_url}/find?api_key=SECRET",
                        {"type": "object", "properties": {}, "additionalProperties": True})
    remove = HttpTool("remove", "", "DELETE", f"{server_url}/items", params)
    broken = HttpTool("broken", "", "DELETE", f"{server_url}/broken", params)

    async def main():
        return [await run_tool(search, {"q": "x", "api_key": "EVIL"}),
                await run_tool(search, {"q": "x", "when": "not a date"}),
                await run_tool(anything, {"api_key": "EVIL", "q": "x"}),
                await run_tool(search, {"q": "x", "when": "2024-02-29"}),
                await run_tool(remove, {"q": "x"}),
                await run_tool(broken, {}),
                # RFC 3339's full-time, as the grammar writes it: jsonschema's check refused it
                await run_tool(search, {"at": "12:30:00Z"}),
                await run_tool(search, {"when": "2023-02-29"}),
                # Python's "$" matched before a last newline
                await run_tool(search, {"when": "2024-02-29\n"})]

    extra, undated, replaced, ok, removed, said, timed, no_day, newline = anyio.run(main)
    assert newline.output.endswith("when: '2024-02-29\\\\n' is not a 'date'\"}"), newline.output
    assert not timed.is_error and json.loads(timed.output)["path"].endswith("at=12%3A30%3A00Z")
    assert no_day.output.endswith("when: '2023-02-29' is not a 'date'\"}"), no_day.output
    assert extra.error_type == "invalid_arguments" and "'api_key' was unexpected" in extra.output
    assert undated.error_type == "invalid_arguments" and "is not a 'date'" in undated.output
    assert replaced.error_type == "invalid_arguments"
    assert "api_key: is the url's own query parameter" in replaced.output
    assert json.loads(ok.output)["path"] == "/find?api_key=SECRET&q=x&when=2024-02-29"
    assert (removed.output, removed.is_error) == ("", False)
    assert (said.output, said.is_error) == ("<html>oops</html>", False)
    assert [p for _, p, _ in Recorder.seen] == ["/find?api_key=SECRET&q=x&when=2024-02-29",
                                                "/items?q=x", "/broken",
                                                "/find?api_key=SECRET&at=12%3A30%3A00Z"]


def test_a_sync_tool_may_run_an_event_loop_of_its_own():
    """An agent as a tool (Runner.run_sync inside a sync tool): anyio refused, "Already running
    asyncio in this thread", as the tool's thread had the caller's async library marked."""
    @tool
    def nested(x: int) -> int:
        async def double():
            await anyio.sleep(0)
            return 2 * x

        return anyio.run(double)

    outcome = anyio.run(run_tool, nested, {"x": 3})
    assert (outcome.output, outcome.is_error) == ("6", False)


def test_sync_tools_run_without_sniffio(monkeypatch):
    # anyio no longer needs it: every sync tool failed with a ModuleNotFoundError without it
    monkeypatch.setitem(sys.modules, "sniffio", None)

    @tool
    def add(a: int, b: int) -> int:
        return a + b

    outcome = anyio.run(run_tool, add, {"a": 1, "b": 2})
    assert (outcome.output, outcome.is_error) == ("3", False)


def test_a_tool_failing_in_a_task_group_names_its_own_error():
    async def fetch() -> str:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep, 5)
            raise OSError("port must be 0-65535")

    outcome = anyio.run(run_tool, tool(fetch), {})
    assert outcome.error_type == "OSError" and "port must be 0-65535" in outcome.output


def test_a_tool_failing_twice_in_a_task_group_names_both_errors():
    # the model read "unhandled errors in a TaskGroup (2 sub-exceptions)" and neither error
    async def fetch() -> str:
        async def fail(err: Exception) -> None:
            raise err

        async with anyio.create_task_group() as tg:
            tg.start_soon(fail, ValueError("no such city"))
            tg.start_soon(fail, KeyError("days"))

    outcome = anyio.run(run_tool, tool(fetch), {})
    assert outcome.is_error and "ValueError: no such city" in outcome.output
    assert "KeyError: 'days'" in outcome.output, outcome.output
    # the first few, walked (a group 400 deep raised RecursionError; 1,000 failed tasks were
    # 84 KB of the model's context)
    from agentflash.errors import described

    deep = ExceptionGroup("g", [ValueError("a")])
    for _ in range(400):
        deep = ExceptionGroup("g", [deep])
    assert described(deep).endswith("(1 sub-exception): ValueError: a")
    wide = described(ExceptionGroup("g", [ValueError(str(i)) for i in range(1000)]))
    assert wide.endswith("ValueError: 3; ValueError: 4; and 995 more"), wide


def test_a_tools_error_reaches_the_model_even_when_it_cannot_be_printed():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    def broken(x: int) -> int:
        raise Unprintable()

    def empty(x: int) -> int:  # next() on an empty iterator, in a thread, then in a coroutine
        return next(iter([]))

    async def empty_async(x: int) -> int:
        return next(iter([]))

    outcome = anyio.run(run_tool, tool(broken), {"x": 1})
    assert outcome.is_error and outcome.error_type == "Unprintable"
    assert json.loads(outcome.output)["error"] == "Unprintable"
    for fn in (empty, empty_async):
        outcome = anyio.run(run_tool, tool(fn), {"x": 1})
        assert outcome.error_type == "StopIteration", outcome
        assert json.loads(outcome.output)["error"] == "StopIteration"


def test_http_tool_definition_errors():
    for url in ("http://[::1/x", "http://127.0.0.1:99999/x", "http://127.0.0.1:abc/x"):
        with pytest.raises(UserError, match=r"url '.*' is not a valid URL"):
            HttpTool("t", "", "GET", url)
    with pytest.raises(UserError, match="parameter 'v' is also in the url's query"):
        HttpTool("t", "", "GET", "http://127.0.0.1/x?v=2",
                 {"type": "object", "properties": {"v": {"type": "integer"}}})
    HttpTool("t", "", "POST", "http://127.0.0.1/x?v=2",  # the arguments go in the body
             {"type": "object", "properties": {"v": {"type": "integer"}}})
    with pytest.raises(UserError, match="url must be an absolute http"):
        HttpTool("t", "", "GET", "file:///etc/passwd")
    # httpx sent the host "exa%20mple.com", which failed at the call naming no host
    for url in ("http://exa mple.com/x", "http://127.0.0.1 :8080/x", "http://h/x y"):
        with pytest.raises(UserError, match="holds a blank or a control character"):
            HttpTool("t", "", "GET", url)
    with pytest.raises(UserError, match="method must be one of"):
        HttpTool("t", "", "FETCH", "http://127.0.0.1/x")
    with pytest.raises(UserError, match="timeout_s must be a positive number, got -1"):
        HttpTool("t", "", "GET", "http://127.0.0.1/x", timeout_s=-1)
    with pytest.raises(UserError, match="not a valid JSON Schema"):
        HttpTool("t", "", "GET", "http://127.0.0.1/x", {"type": "objekt"})
    with pytest.raises(UserError, match="parameters must be a JSON Schema of type object"):
        HttpTool("t", "", "GET", "http://127.0.0.1/x", {"type": "string"})
    with pytest.raises(ToolArgumentsError):
        anyio.run(HttpTool("t", "", "GET", "http://127.0.0.1:9/x").call, {"extra": 1})


def test_a_tools_description_that_is_no_string_is_refused_when_the_tool_is_made():
    def f(x: int) -> int:
        """Doc."""
        return x

    # 5 and b"x" were kept, and shown to the model as 5 and b'x'
    for bad, kind in ((5, "int"), (b"x", "bytes"), (["a"], "list")):
        with pytest.raises(UserError, match=f"f: description must be a string, got {kind}$"):
            tool(description=bad)(f)
        with pytest.raises(UserError, match=f"^http tool 't': description must be a string, "
                                            f"got {kind}$") as err:
            HttpTool("t", bad, "GET", "http://127.0.0.1/x")
        assert err.value.key == ("description",)  # a workflow's error names that line
    with pytest.raises(UserError, match="description must be a string, got NoneType"):
        HttpTool("t", None, "GET", "http://127.0.0.1/x")  # no docstring to read it from
    assert tool(description=None)(f).description == "Doc."  # None: the docstring's
    assert tool(description="")(f).description == ""


def test_numpy_values_a_tool_returns_reach_the_model_as_json_values():
    import numpy as np

    from agentflash.runtime.tools import format_result

    # they were their text: "3", "True", "[0 1 2]"
    value = {"count": np.int64(3), "ok": np.bool_(True), "hist": np.arange(3),
             "half": np.float32(1.5), "grid": np.ones((2, 2), dtype=np.int8),
             "price": np.float32(0.1), "scores": np.array([[0.3, 0.7]], dtype=np.float16)}
    assert json.loads(format_result(value)) == {"count": 3, "ok": True, "hist": [0, 1, 2],
                                                "half": 1.5, "grid": [[1, 1], [1, 1]],
                                                "price": 0.1, "scores": [[0.3, 0.7]]}


def test_tensors_and_keys_that_meet_in_json_reach_the_model_whole_or_refused():
    import torch

    from agentflash.runtime.tools import format_result

    # a tensor was its shortened text: "tensor([0.0000e+00, ..., 1.9990e+02])", 1,994 values lost
    values = json.loads(format_result({"scores": torch.arange(2000) / 10, "n": torch.tensor(3)}))
    assert len(values["scores"]) == 2000 and values["scores"][1] == pytest.approx(0.1)
    assert values["n"] == 3
    # by their shortest digits, as numpy's: 0.1, not 0.10000000149011612
    assert json.loads(format_result(torch.tensor([0.1, 0.2]))) == [0.1, 0.2]
    assert json.loads(format_result(torch.tensor([0.1], dtype=torch.bfloat16))) == [0.100097656]
    assert json.loads(format_result(torch.tensor([0.1], dtype=torch.float16))) == [0.1]
    # {1: "one", "1": "uno"} was {"1": "uno"}: a value dropped without a word
    import dataclasses

    import pydantic

    @dataclasses.dataclass
    class Held:
        d: dict

    class Model(pydantic.BaseModel):
        d: dict[int | str, str]

    class Aliased(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="allow")
        d: dict = pydantic.Field(alias="data")

    twice = {1: "a", "1": "b"}
    for value in ({1: "one", "1": "uno"}, [{"a": {None: 1, "None": 2}}], Held(twice),
                  [Model(d=twice)], {True: twice}, {b"k": twice}, Aliased(data=twice),
                  Aliased(data={}, x=twice), pydantic.RootModel[dict[int | str, str]](twice)):
        with pytest.raises(ValueError, match="are one key"):
            format_result(value)
    assert json.loads(format_result({1: "one", 2: ["x", {3: "y"}]})) == {"1": "one",
                                                                         "2": ["x", {"3": "y"}]}


def test_containers_pydantic_does_not_know_reach_the_model_as_json():
    import array
    import ctypes
    import types
    from collections import UserString

    import numpy as np

    from agentflash.runtime.tools import format_result

    d = {"a": 1, "b": 2}  # each was its repr: "dict_keys(['a', 'b'])", "<memory at 0x...>"
    for value, written in ((d.keys(), ["a", "b"]), (d.values(), [1, 2]),
                           (d.items(), [["a", 1], ["b", 2]]), (range(2), [0, 1]),
                           (types.MappingProxyType(d), d), (array.array("i", [1, 2]), [1, 2]),
                           (memoryview(b"ab"), "ab"), ({"k": range(1)}, {"k": [0]}),
                           # a typed view's items (its raw bytes were written), a UserString
                           # (a Sequence of UserStrings: a RecursionError)
                           (memoryview(array.array("i", [1, 2])), [1, 2]),
                           (memoryview(array.array("d", [1.5])), [1.5]),
                           (memoryview(np.array([1.5], dtype=np.float16)), [1.5]),  # not in
                           (memoryview(np.array([1, 2], dtype=">i4")), [1, 2]),  # tolist's
                           (memoryview(ctypes.create_string_buffer(b"hi", 2)), "hi"),  # "<c"

                           (UserString("hi"), "hi"), ({"k": UserString("hi")}, {"k": "hi"})):
        assert json.loads(format_result(value)) == written
    with pytest.raises(ValueError, match="are one key"):
        format_result(types.MappingProxyType({1: "one", "1": "uno"}))


def test_an_error_result_keeps_its_characters():
    @tool
    def find(city: str) -> str:
        raise ValueError(f"ville introuvable: {city}")

    outcome = anyio.run(run_tool, find, {"city": "Zürich 日本"})
    # escaped as \u00fc and \u65e5\u672c: several tokens a character, where a result is not
    assert outcome.output == '{"status": "error", "error": "ValueError: ville introuvable: ' \
                             'Zürich 日本"}'


def test_async_generators_behind_a_wrapper_are_taken_and_a_timed_out_generator_is_left():
    @tool
    @plain_wrapper
    async def counted(n: int):
        for i in range(n):
            yield i

    taken = []

    @tool(timeout_s=0.3)
    def endless() -> str:
        while True:
            time.sleep(0.01)
            taken.append(1)
            yield "item"

    # the async one was its repr ("<async_generator object ...>"), its body never run; the
    # sync one's items were taken for ever after its timeout, by the runtime's own thread
    assert anyio.run(run_tool, counted, {"n": 3}).output == "[0, 1, 2]"
    outcome = anyio.run(run_tool, endless, {})
    assert outcome.is_error and "timed out after 0.3 s" in outcome.output
    time.sleep(0.3)
    count = len(taken)
    time.sleep(0.5)
    assert len(taken) <= count + 1
