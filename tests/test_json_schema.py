"""JSON Schema -> regex: valid instances match, sampled matches validate, near-misses fail."""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import json
import math
import random
import re
import uuid
from collections import defaultdict, deque
from decimal import Decimal
from enum import Enum
from typing import Any, Literal

import interegular
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interegular.fsm import anything_else
from pydantic import BaseModel, ConfigDict, Field

from lmnb.runtime.fsm.json_schema import (
    InvalidSchemaError,
    dtype_regex,
    json_schema_to_regex,
)
from lmnb.runtime.fsm.regex import ByteFSM, compile_regex

FLEXIBLE = r"[ \n\t]{0,2}"


class Job(str, Enum):
    wizard = "wizard"
    muggle = "muggle"
    house_elf = "house elf"


class Wand(BaseModel):
    model_config = ConfigDict(extra="forbid")
    wood: str
    core: Literal["phoenix feather", "unicorn hair", "dragon heartstring"]
    length: float = Field(gt=0, le=20)


class Character(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    job: Job
    wand: Wand | None = None
    alive: bool = True
    friends: list[str] = Field(default_factory=list, max_length=2)


class Address(BaseModel):
    street: str | None = None
    city: str | None = None
    zip: str | None = Field(default=None, pattern=r"^\d{5}$")


class Person(BaseModel):
    id: uuid.UUID
    born: dt.date
    seen: dt.datetime | None = None
    scores: list[int] = Field(default_factory=list, max_length=3)
    address: Address | None = None
    point: tuple[int, str] | None = None


class Node(BaseModel):
    value: int
    children: list[Node] = Field(default_factory=list, max_length=2)


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: float = Field(ge=0)


class Square(BaseModel):
    kind: Literal["square"]
    side: int = Field(gt=0)


class Drawing(BaseModel):
    shapes: list[Circle | Square] = Field(max_length=3)
    title: str | None = None


CHARACTER_ENUM = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "job": {"type": "string", "enum": ["wizard", "muggle", "house elf"]}},
    "required": ["name", "age", "job"],
}
CHARACTER_PATTERN = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0},
                   "job": {"type": "string", "pattern": r"^[A-Z][a-z]+( [a-z]+)?$"}},
    "required": ["name", "age"],
}
OPTIONALS = {  # no required property: every subset of members, commas right
    "type": "object",
    "properties": {k: {"type": t} for k, t in
                   [("a", "integer"), ("b", "boolean"), ("c", "null"), ("d", "string")]},
}
MIXED = {
    "type": "object",
    "properties": {k: {"type": "integer"} for k in "abcdef"},
    "required": ["c", "e"],
}
SCHEMAS: dict[str, Any] = {
    "character_enum": CHARACTER_ENUM,
    "character_pattern": CHARACTER_PATTERN,
    "character_pydantic": Character.model_json_schema(),
    "person_pydantic": Person.model_json_schema(),
    "recursive_pydantic": Node.model_json_schema(),
    "union_pydantic": Drawing.model_json_schema(),
    "optionals": OPTIONALS,
    "mixed": MIXED,
    "refs": {
        "$defs": {"pos": {"$ref": "#/definitions/nat"}, "pair": {
            "type": "array", "items": {"$ref": "#/$defs/pos"}, "minItems": 2, "maxItems": 2}},
        "definitions": {"nat": {"type": "integer", "minimum": 1, "maximum": 999}},
        "type": "object", "properties": {"p": {"$ref": "#/$defs/pair"},
                                         "q": {"allOf": [{"$ref": "#/$defs/pos"}]}},
        "required": ["p"],
    },
    "any_of": {"anyOf": [{"type": "integer", "maximum": -1}, {"type": "string", "maxLength": 3},
                         {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    "type_list": {"type": ["string", "null"], "format": "email"},
    "const_enum": {"type": "object", "properties": {
        "v": {"const": {"k": [1, "x", None], "é": 2.5}},
        "w": {"enum": [True, 3, "a\"b\\c\n", [], {}, "naïve"]}}, "required": ["v"]},
    "formats": {"type": "array", "prefixItems": [
        {"type": "string", "format": f} for f in ("date", "date-time", "time", "uuid", "email")],
        "items": False},
    "strings": {"anyOf": [
        {"type": "string", "minLength": 2, "maxLength": 4},
        {"type": "string", "pattern": r"^\d{3}-\d{2}$"},
        {"type": "string", "pattern": r"x[^,]y"},
        {"type": "string", "pattern": r"^.{2}$"},
        {"type": "string", "pattern": r"^a\"b\\c\s$"},
        {"type": "string", "pattern": r"^(foo|ba+r)+\W$"},
    ]},
    "numbers": {"type": "object", "properties": {
        "i": {"type": "integer", "minimum": -25, "exclusiveMaximum": 1003},
        "x": {"type": "number", "minimum": -2.5, "maximum": 10.125},
        "y": {"type": "number", "exclusiveMinimum": 0},
        "z": {"type": "number"}}, "required": ["i", "x", "y", "z"]},
    "tuple_items": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                    "items": {"type": "null"}, "minItems": 1, "maxItems": 4},
    "map": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "any": {},
}
ENSURE_ASCII_OK = {"character_enum", "optionals", "mixed", "refs", "map", "any", "numbers"}


# ---------------------------------------------------------------- instance generator

def _merge(schema: dict, root: dict) -> dict:
    while "$ref" in schema or "allOf" in schema:
        if "$ref" in schema:
            target = _resolve(root, schema["$ref"])
            schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        else:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            for item in schema["allOf"]:
                rest = {**rest, **item}
            schema = rest
    return schema


def _resolve(root: dict, ref: str) -> dict:
    node = root
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return node


def _json_values(depth: int) -> st.SearchStrategy:
    scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=5) \
        | st.floats(allow_nan=False, allow_infinity=False)
    if depth == 0:
        return scalars
    inner = _json_values(depth - 1)
    return scalars | st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                     max_size=3)


def _plain(x: float) -> bool:
    return "e" not in repr(x) and "inf" not in repr(x)


class Instances:
    """Hypothesis strategies for a schema, under the same bounds as the regex builder."""

    def __init__(self, root: Any, max_recursion: int = 3, any_depth: int = 2) -> None:
        self.root, self.max_recursion, self.any_depth = root, max_recursion, any_depth
        self.expanding: dict[str, int] = defaultdict(int)

    def of(self, schema: Any) -> st.SearchStrategy | None:
        if schema is True or schema == {}:
            return _json_values(self.any_depth)
        if "$ref" in schema:
            ref = schema["$ref"]
            if self.expanding[ref] >= self.max_recursion:
                return None
            self.expanding[ref] += 1
            try:
                return self.of(_merge(schema, self.root))
            finally:
                self.expanding[ref] -= 1
        schema = _merge(schema, self.root)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = [s for s in map(self.of, schema[key]) if s is not None]
                return st.one_of(options) if options else None
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.of({**schema, "type": k}) for k in kind])
        if kind is None:
            kind = "object" if "additionalProperties" in schema else None
        return getattr(self, f"_{kind}")(schema)

    def _null(self, schema: dict) -> st.SearchStrategy:
        return st.none()

    def _boolean(self, schema: dict) -> st.SearchStrategy:
        return st.booleans()

    def _integer(self, schema: dict) -> st.SearchStrategy:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            lo = schema["exclusiveMinimum"] + 1
        if "exclusiveMaximum" in schema:
            hi = schema["exclusiveMaximum"] - 1
        return st.integers(lo, hi)

    def _number(self, schema: dict) -> st.SearchStrategy:
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        if lo is None and hi is None:
            return st.floats(allow_nan=False, allow_infinity=False) | st.integers()
        floats = st.floats(lo, hi, exclude_min="exclusiveMinimum" in schema,
                           exclude_max="exclusiveMaximum" in schema).filter(_plain)
        decimals = st.decimals(lo, hi, allow_nan=False, allow_infinity=False, places=3)
        decimals = decimals.map(float).filter(_plain)
        valid = st.one_of(floats, decimals)
        return valid.filter(lambda x: not ("exclusiveMinimum" in schema and x <= lo))

    def _string(self, schema: dict) -> st.SearchStrategy:
        chars = st.characters(codec="utf-8")
        if "pattern" in schema:  # `$` is ECMA's: no newline before the end
            pattern = schema["pattern"]
            return st.from_regex(pattern, alphabet=chars).filter(
                lambda s: not (pattern.endswith("$") and s.endswith("\n")))
        formats = {
            "date": st.dates().map(str),
            "time": st.times(timezones=st.integers(-1439, 1439).map(
                lambda m: dt.timezone(dt.timedelta(minutes=m)))).map(lambda t: t.isoformat()),
            "date-time": st.datetimes(timezones=st.just(dt.timezone.utc)).map(
                lambda t: t.isoformat().replace("+00:00", "Z")),
            "uuid": st.uuids().map(str),
            "email": st.emails(),
        }
        if schema.get("format") in formats:
            return formats[schema["format"]]
        return st.text(chars, min_size=schema.get("minLength", 0),
                       max_size=schema.get("maxLength", 8))

    def _array(self, schema: dict) -> st.SearchStrategy | None:
        prefix = [self.of(s) for s in schema.get("prefixItems", [])]
        items = schema.get("items", True)
        rest = None if items is False else self.of(items)
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", 4)
        if None in prefix:
            prefix, hi = prefix[:prefix.index(None)], min(hi, prefix.index(None))
        options = [st.tuples(*prefix[:n]).map(list) for n in range(lo, min(hi, len(prefix)) + 1)]
        if rest is not None and hi > len(prefix):
            tail = st.lists(rest, min_size=max(lo - len(prefix), 0), max_size=hi - len(prefix))
            options.append(st.tuples(st.tuples(*prefix), tail).map(lambda t: [*t[0], *t[1]]))
        return st.one_of(options) if options else None

    def _object(self, schema: dict) -> st.SearchStrategy | None:
        if "properties" not in schema:
            values = self.of(schema.get("additionalProperties", True))
            return st.dictionaries(st.text(max_size=4), values,
                                   max_size=schema.get("maxProperties", 3))
        required = set(schema.get("required", []))
        fields = []
        for name, sub in schema["properties"].items():
            value = self.of(sub)
            if value is None:
                if name in required:
                    return None
                continue
            present = st.just(True) if name in required else st.booleans()
            fields.append(st.tuples(st.just(name), present, value))
        return st.tuples(*fields).map(lambda t: {k: v for k, keep, v in t if keep})


# ---------------------------------------------------------------- helpers

FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def validate(instance: Any, schema: dict) -> None:
    jsonschema.validate(instance, schema, format_checker=FORMAT_CHECKER)


@functools.cache
def regex_of(name: str, whitespace: str | None = None) -> str:
    return json_schema_to_regex(SCHEMAS[name], whitespace=whitespace)


@functools.cache
def fsm_of(name: str, whitespace: str | None = None) -> Any:
    return interegular.parse_pattern(regex_of(name, whitespace)).to_fsm()


def dumps_flexible(value: Any, ws: Any) -> str:
    if isinstance(value, dict):
        members = [f"{json.dumps(k, ensure_ascii=False)}{ws()}:{ws()}{dumps_flexible(v, ws)}"
                   for k, v in value.items()]
        return "{" + ws() + f"{ws()},{ws()}".join(members) + (ws() if members else "") + "}"
    if isinstance(value, list):
        items = [dumps_flexible(v, ws) for v in value]
        return "[" + ws() + f"{ws()},{ws()}".join(items) + (ws() if items else "") + "]"
    return json.dumps(value, ensure_ascii=False)


def random_walk(fsm: Any, rng: random.Random, max_len: int = 120) -> str:
    """A random accepted string: random live transitions, steering to a final state when long."""
    predecessors = defaultdict(set)
    for state, transitions in fsm.map.items():
        for target in transitions.values():
            predecessors[target].add(state)
    distance = {state: 0 for state in fsm.finals}
    queue = deque(fsm.finals)
    while queue:
        state = queue.popleft()
        for previous in predecessors[state]:
            if previous not in distance:
                distance[previous] = distance[state] + 1
                queue.append(previous)
    symbols = defaultdict(list)
    for symbol, cls in fsm.alphabet.items():
        symbols[cls].append(symbol)
    known = {s for s in fsm.alphabet.keys() if s is not anything_else}
    others = [c for c in "éZ中😀~#Q" if c not in known]
    state, out = fsm.initial, []
    while True:
        options = [(cls, target) for cls, target in fsm.map.get(state, {}).items()
                   if target in distance]
        if len(out) > max_len:
            options = [o for o in options if distance[o[1]] < distance[state]]
        if state in fsm.finals and (rng.random() < 0.15 or not options):
            return "".join(out)
        cls, state = rng.choice(options)
        symbol = rng.choice(symbols[cls])
        out.append(rng.choice(others) if symbol is anything_else else symbol)


# ---------------------------------------------------------------- (a) instances match

@pytest.mark.parametrize("name", SCHEMAS)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_valid_instances_match(name: str, data: st.DataObject) -> None:
    schema = SCHEMAS[name]
    strategy = Instances(schema).of(schema)
    instance = data.draw(strategy)
    validate(instance, schema)
    text = json.dumps(instance, ensure_ascii=False)
    assert re.fullmatch(regex_of(name), text), text
    if name in ENSURE_ASCII_OK:
        assert re.fullmatch(regex_of(name), json.dumps(instance)), json.dumps(instance)
    compact = json.dumps(instance, ensure_ascii=False, separators=(",", ":"))
    assert re.fullmatch(regex_of(name, ""), compact), compact
    spaced = dumps_flexible(instance, lambda: data.draw(st.text(" \n\t", max_size=2)))
    assert re.fullmatch(regex_of(name, FLEXIBLE), spaced), spaced


# ---------------------------------------------------------------- (b) matches are valid

WALKED = [name for name in SCHEMAS if name != "any"]
FLEX_WALKED = ["character_enum", "person_pydantic", "recursive_pydantic", "const_enum", "map",
               "tuple_items", "optionals"]


@pytest.mark.parametrize("name", WALKED)
def test_sampled_matches_are_valid(name: str) -> None:
    rng = random.Random(name)
    for whitespace in (None, FLEXIBLE) if name in FLEX_WALKED else (None,):
        regex, fsm = regex_of(name, whitespace), fsm_of(name, whitespace)
        for _ in range(30):
            text = random_walk(fsm, rng)
            assert re.fullmatch(regex, text), text
            validate(json.loads(text), SCHEMAS[name])


def test_sampled_any_values_are_json() -> None:
    rng, fsm, seen = random.Random(0), fsm_of("any"), set()
    for _ in range(500):
        seen.add(type(json.loads(random_walk(fsm, rng))))
        if len(seen) == 7:
            break
    assert seen == {list, dict, str, int, float, bool, type(None)}


@pytest.mark.parametrize("name", ["character_pydantic", "person_pydantic", "strings", "numbers"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_texts_that_match_are_valid(name: str, data: st.DataObject) -> None:
    schema = SCHEMAS[name]
    text = json.dumps(data.draw(Instances(schema).of(schema)), ensure_ascii=False)
    position = data.draw(st.integers(0, len(text)))
    edit = data.draw(st.sampled_from(["insert", "delete", "replace"]))
    char = data.draw(st.sampled_from(list(',:"\\{}[]0-.e aZ\n') + ["\\u0041"]))
    head, tail = text[:position], text[position:]
    mutated = {"insert": head + char + tail, "delete": head + tail[1:],
               "replace": head + char + tail[1:]}[edit]
    if re.fullmatch(regex_of(name), mutated):
        validate(json.loads(mutated), schema)


# ---------------------------------------------------------------- (c) near-misses

def test_character_near_misses() -> None:
    regex = json_schema_to_regex(CHARACTER_ENUM)
    good = '{"name": "Harry", "age": 11, "job": "wizard"}'
    assert re.fullmatch(regex, good)
    for bad in ['{"name": "Harry", "job": "wizard"}', '{"name": "Harry", "age": "11", "job": '
                '"wizard"}', '{"name": "Harry", "age": 11, "job": "witch"}',
                '{"name": "Harry",, "age": 11, "job": "wizard"}',
                '{"name": "Harry", "age": 11, "job": "wizard",}',
                '{, "name": "Harry", "age": 11, "job": "wizard"}',
                '{"age": 11, "name": "Harry", "job": "wizard"}',
                '{"name": "Harry", "age": 11, "job": "wizard", "x": 1}',
                '{"name":"Harry","age":11,"job":"wizard"}', '{"name": "Ha"rry", "age": 11, '
                '"job": "wizard"}', '{"name": "Harry", "age": 011, "job": "wizard"}',
                '{"name": "Har\nry", "age": 11, "job": "wizard"}']:
        assert not re.fullmatch(regex, bad), bad
    flexible = json_schema_to_regex(CHARACTER_ENUM, whitespace=FLEXIBLE)
    assert re.fullmatch(flexible, '{\n "name":"Harry" ,\t"age" : 11,"job": "wizard"\n}')
    assert not re.fullmatch(flexible, '{"name":    "Harry", "age": 11, "job": "wizard"}')


def test_pattern_job_and_pydantic_near_misses() -> None:
    regex = regex_of("character_pattern")
    assert re.fullmatch(regex, '{"name": "Ron", "age": 11, "job": "Keeper of keys"}') is None
    assert re.fullmatch(regex, '{"name": "Ron", "age": 11, "job": "Keeper keys"}')
    assert re.fullmatch(regex, '{"name": "Ron", "age": 11}')
    assert not re.fullmatch(regex, '{"name": "", "age": 11}')
    assert not re.fullmatch(regex, '{"name": "Ron", "age": -1}')
    assert not re.fullmatch(regex, '{"name": "Ron", "age": 11, "job": "keeper"}')
    regex = regex_of("character_pydantic")
    good = {"name": "Hermione", "age": 12, "job": "wizard",
            "wand": {"wood": "vine", "core": "dragon heartstring", "length": 10.75},
            "alive": True, "friends": ["Harry", "Ron"]}
    assert re.fullmatch(regex, json.dumps(good))
    for key, value in [("age", 151), ("age", 1.5), ("job", "witch"), ("alive", "true"),
                       ("friends", ["a", "b", "c"]), ("name", "x" * 13), ("wand", {"wood": "x"}),
                       ("wand", {"wood": "x", "core": "unicorn hair", "length": 0})]:
        assert not re.fullmatch(regex, json.dumps({**good, key: value})), (key, value)
    assert not re.fullmatch(regex, json.dumps({k: v for k, v in good.items() if k != "job"}))


def test_optional_member_combinations() -> None:
    for schema in (OPTIONALS, MIXED):
        regex = json_schema_to_regex(schema)
        names = list(schema["properties"])
        values = {"a": 1, "b": True, "c": None, "d": "x", "e": 5, "f": 6}
        for mask in itertools.product([False, True], repeat=len(names)):
            present = [n for n, keep in zip(names, mask, strict=True) if keep]
            text = json.dumps({n: values[n] for n in present})
            valid = set(schema.get("required", [])) <= set(present)
            if schema is MIXED:
                text = json.dumps({n: 1 for n in present})
            assert bool(re.fullmatch(regex, text)) == valid, text
            assert not re.fullmatch(regex, text.replace("{", "{, ").replace("}", ", }"))


def test_regex_size_is_linear_in_properties() -> None:
    def size(n: int, required: list[str]) -> int:
        props = {f"p{i}": {"type": "integer"} for i in range(n)}
        return len(json_schema_to_regex({"properties": props, "required": required}))

    for required in ([], ["p0"], ["p19"]):
        assert size(40, [r.replace("19", "39") for r in required]) < 2.2 * size(20, required)


def test_recursion_is_bounded() -> None:
    regex = regex_of("recursive_pydantic")
    leaf = {"value": 1, "children": []}
    tree = {"value": 0, "children": [{"value": 1, "children": [leaf, leaf]}]}
    assert re.fullmatch(regex, json.dumps(tree))
    deep = {"value": 0, "children": [{"value": 1, "children": [{"value": 2, "children": [
        {"value": 3, "children": []}]}]}]}
    assert not re.fullmatch(regex, json.dumps(deep))
    assert re.fullmatch(json_schema_to_regex(Node, max_recursion=4), json.dumps(deep))
    linked = {"$defs": {"L": {"type": "object", "properties": {"next": {"$ref": "#/$defs/L"}}}},
              "$ref": "#/$defs/L"}
    assert re.fullmatch(json_schema_to_regex(linked), '{"next": {"next": {}}}')
    with pytest.raises(InvalidSchemaError, match="recursion"):
        json_schema_to_regex({"$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/A"},
                                              "minItems": 1}}, "$ref": "#/$defs/A"})


def test_recursion_through_all_of_is_bounded() -> None:
    # `allOf: [{"$ref": ...}]` (a ref with a description beside it) counts like a plain $ref;
    # it recursed until RecursionError.
    node = {"type": "object", "properties": {
        "next": {"allOf": [{"$ref": "#/$defs/N"}], "description": "the tail"}}}
    regex = json_schema_to_regex({"$defs": {"N": node}, "$ref": "#/$defs/N"})
    assert re.fullmatch(regex, '{"next": {"next": {}}}')
    assert not re.fullmatch(regex, '{"next": {"next": {"next": {"next": {}}}}}')
    with pytest.raises(InvalidSchemaError, match="recursion"):
        json_schema_to_regex({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}]}},
                              "$ref": "#/$defs/A"})


def test_refs_by_percent_encoded_pointer_and_by_anchor() -> None:
    """A `$ref` is a URI fragment: a JSON pointer is percent-decoded (then '~1' is '/', '~0'
    '~'), and a plain name is an `$anchor` (or a pre-2019 `$id: "#name"`)."""
    defs = {"a b": {"type": "integer", "minimum": 0, "maximum": 9},
            "x/y~": {"type": "boolean"},
            "anchored": {"$anchor": "flag", "enum": ["on", "off"]},
            "old": {"$id": "#legacy", "type": "null"}}
    schema = {"$defs": defs, "type": "object", "properties": {
        "n": {"$ref": "#/$defs/a%20b"}, "b": {"$ref": "#/$defs/x~1y~0"},
        "f": {"$ref": "#flag"}, "z": {"$ref": "#legacy"}},
        "required": ["n", "b", "f", "z"]}
    regex = json_schema_to_regex(schema)
    document = {"n": 7, "b": True, "f": "off", "z": None}
    assert re.fullmatch(regex, json.dumps(document))
    # as jsonschema resolves them (2020-12, which no longer takes '$id' fragments)
    modern = {**schema, "$defs": {k: v for k, v in defs.items() if k != "old"},
              "properties": {k: v for k, v in schema["properties"].items() if k != "z"},
              "required": ["n", "b", "f"]}
    jsonschema.validate({k: v for k, v in document.items() if k != "z"}, modern)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"n": 7, "b": True, "f": "maybe"}, modern)
    assert not re.fullmatch(regex, json.dumps({**document, "f": "maybe"}))
    with pytest.raises(InvalidSchemaError, match="no '\\$anchor'"):
        json_schema_to_regex({"$ref": "#nowhere"})


@settings(max_examples=300, deadline=None)
@given(lo=st.none() | st.integers(-3000, 3000), span=st.integers(0, 5000),
       hi_none=st.booleans(), exclusive=st.booleans(), value=st.integers(-6000, 6000))
def test_integer_ranges(lo: int | None, span: int, hi_none: bool, exclusive: bool,
                        value: int) -> None:
    hi = None if hi_none else (lo or 0) + span
    schema: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        schema["exclusiveMinimum" if exclusive else "minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    inside = (lo is None or (value > lo if exclusive else value >= lo)) and \
        (hi is None or value <= hi)
    try:
        regex = json_schema_to_regex(schema)
    except InvalidSchemaError:
        assert lo is not None and hi is not None and exclusive and hi <= lo
        return
    assert bool(re.fullmatch(regex, str(value))) == inside, (schema, value)


BOUNDS = st.none() | st.decimals(-50, 50, places=3).map(lambda d: float(d.normalize()))


@settings(max_examples=400, deadline=None)
@given(lo=BOUNDS, hi=BOUNDS, lo_excl=st.booleans(), hi_excl=st.booleans(),
       value=st.decimals(-60, 60, places=4), trailing=st.integers(0, 2), sign=st.booleans())
def test_number_ranges(lo: float | None, hi: float | None, lo_excl: bool, hi_excl: bool,
                       value: Decimal, trailing: int, sign: bool) -> None:
    schema: dict[str, Any] = {"type": "number"}
    if lo is not None:
        schema["exclusiveMinimum" if lo_excl else "minimum"] = lo
    if hi is not None:
        schema["exclusiveMaximum" if hi_excl else "maximum"] = hi
    text = format(value, "f") + ("0" * trailing if "." in format(value, "f") else "")
    if sign and not text.startswith("-"):
        text = "-" + text if value == 0 else text
    inside = (lo is None or (value > Decimal(repr(lo)) if lo_excl else value >= Decimal(repr(lo)))
              ) and (hi is None or (value < Decimal(repr(hi)) if hi_excl
                                    else value <= Decimal(repr(hi))))
    try:
        regex = json_schema_to_regex(schema)
    except InvalidSchemaError:
        assert not inside
        return
    assert bool(re.fullmatch(regex, text)) == inside, (schema, text)


def _decimal_text(value: Decimal) -> str:
    """`value` as a JSON number without an exponent (no trailing fraction zeros)."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


@pytest.mark.parametrize("bounds, refused, accepted", [
    ({"exclusiveMaximum": 1}, ["0.99999999999999999999", "0.99999999999999995"],
     ["0.9999999999999999", "0.5", "-3"]),
    ({"exclusiveMinimum": 0.1}, ["0.10000000000000000001", "0.100000000000000005"],
     ["0.10000000000000002", "7"]),
    ({"exclusiveMaximum": 1e16}, ["9999999999999999", "9999999999999999.5"],
     ["9999999999999998", "12.5"]),
    ({"exclusiveMinimum": 0, "maximum": 1}, ["0." + "0" * 323 + "1", "0." + "0" * 330 + "7"],
     ["0." + "0" * 322 + "1", "0.5", "1"]),
    ({"exclusiveMaximum": 0, "minimum": -1}, ["-0." + "0" * 323 + "1"],
     ["-0." + "0" * 322 + "1", "-1"]),
])
def test_exclusive_bounds_hold_after_float_parsing(bounds: dict, refused: list[str],
                                                   accepted: list[str]) -> None:
    """A number whose double lands on an exclusive bound (or underflows to 0 past an exclusive 0)
    is refused; its neighbours that parse inside are not."""
    regex = json_schema_to_regex({"type": "number", **bounds})
    fsm = compile_regex(regex)  # the runtime's automaton, beside Python's re
    for text in refused:
        assert not re.fullmatch(regex, text) and not fsm.fullmatch(text), (bounds, text)
    for text in accepted:
        assert re.fullmatch(regex, text) and fsm.fullmatch(text), (bounds, text)
        jsonschema.validate(float(text), {"type": "number", **bounds})
    with pytest.raises(InvalidSchemaError):  # no double lies strictly between two adjacent ones
        json_schema_to_regex({"type": "number", "exclusiveMinimum": 1.0,
                              "exclusiveMaximum": 1.0000000000000002})


def _near(bound: float) -> set[str]:
    """Plain decimals around `bound` that float parsing rounds onto it or its neighbours:
    bound +- 10^-k for growing k, its neighbouring doubles (shortest and exact decimals) and
    the midpoints between them, just below and above each."""
    exact = Decimal(bound)
    texts = set()
    scale = exact.adjusted() if bound else -300
    for k in range(0, 32):
        step = Decimal(10) ** (scale - k)
        texts.update(_decimal_text(exact + sign * step) for sign in (-1, 1))
    doubles = [bound]
    for direction in (-math.inf, math.inf):
        x = bound
        for _ in range(2):
            x = math.nextafter(x, direction)
            doubles.append(x)
    for x in doubles:
        texts.update({_decimal_text(Decimal(repr(x))), _decimal_text(Decimal(x))})
        for y in (math.nextafter(x, -math.inf), math.nextafter(x, math.inf)):
            middle = (Decimal(x) + Decimal(y)) / 2
            tiny = Decimal(10) ** (middle.adjusted() - 30)
            texts.update(_decimal_text(middle + d) for d in (-tiny, 0, tiny))
    return texts


def _byte_walk(fsm: ByteFSM, rng: random.Random) -> str:
    """A random text the runtime's automaton accepts (it is trim: every state can still end)."""
    state, out = fsm.initial, bytearray()
    while True:
        moves = list(fsm.transitions[state].items())
        if not moves or (fsm.is_accepting(state) and rng.random() < 0.2):
            return out.decode()
        byte, state = rng.choice(moves)
        out.append(byte)


BOUND_FLOATS = st.sampled_from([0.0, 1.0, 0.1, -0.3, 1e16, 2.0 ** 53, 1e-7, 123.456]) | st.floats(
    -1e20, 1e20).filter(lambda x: x == 0 or abs(x) >= 1e-20)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(bound=BOUND_FLOATS, upper=st.booleans(), exclusive=st.booleans(),
       seed=st.integers(0, 999))
def test_every_accepted_bounded_number_parses_within_its_bound(bound: float, upper: bool,
                                                               exclusive: bool,
                                                               seed: int) -> None:
    keyword = ("exclusiveMaximum" if exclusive else "maximum") if upper else (
        "exclusiveMinimum" if exclusive else "minimum")
    regex = json_schema_to_regex({"type": "number", keyword: bound})
    fsm = compile_regex(regex)

    def within(x: float) -> bool:
        if upper:
            return x < bound if exclusive else x <= bound
        return x > bound if exclusive else x >= bound

    for text in _near(bound):
        assert bool(re.fullmatch(regex, text)) == fsm.fullmatch(text), (keyword, bound, text)
        if fsm.fullmatch(text):
            assert within(float(text)), (keyword, bound, text)
    # not vacuous: the double next to the bound inside the range is accepted (past an exclusive
    # 0, from 1e-323 on: smaller ones parse to 0)
    inside = math.nextafter(bound, -math.inf if upper else math.inf)
    if bound == 0:
        inside = math.copysign(1e-323, inside)
    assert fsm.fullmatch(_decimal_text(Decimal(repr(inside)))), (keyword, bound, inside)
    rng = random.Random(seed)
    for _ in range(20):
        text = _byte_walk(fsm, rng)
        assert within(float(text)), (keyword, bound, text)


def test_strings_and_escapes() -> None:
    regex = json_schema_to_regex({"type": "string", "minLength": 2, "maxLength": 2})
    for text in ['"ab"', r'"\n\""', r'"\u00e9x"', r'"\ud83d\ude00x"', '"😀x"', r'"\/\\"']:
        assert re.fullmatch(regex, text), text
    for text in ['"a"', '"abc"', r'"\ud83d"', r'"\x41b"', '"a\tb"', r'"\ude00\ud83d"', '"a"b"']:
        assert not re.fullmatch(regex, text), text
    pattern = json_schema_to_regex({"type": "string", "pattern": "^a.b$"})
    assert re.fullmatch(pattern, r'"a\"b"') and re.fullmatch(pattern, r'"a\tb"')
    assert not re.fullmatch(pattern, r'"a\nb"') and not re.fullmatch(pattern, '"a"b"')
    search = json_schema_to_regex({"type": "string", "pattern": "[0-9]{2}"})
    assert re.fullmatch(search, '"x12y"') and not re.fullmatch(search, '"x1y2"')


PATTERNS = [r"^[ -~]{1,3}$", r"^[^a-z]+$", r'["\\]', r"^\w+\s\d*$", r'^(?:a|b"|\\)*?$',
            r"^[\x00-\x7f]$", r"^\S[^\s,]?$", r"^[\D\n]{2}$", r"x$", r"^[é-ü😀]+\.$", r""]


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_pattern_translation(pattern: str, data: st.DataObject) -> None:
    regex = json_schema_to_regex({"type": "string", "pattern": pattern})
    value = data.draw(Instances({})._string({"pattern": pattern}))
    assert re.fullmatch(regex, json.dumps(value, ensure_ascii=False)), (regex, value)
    if data.draw(st.booleans()):
        text = random_walk(_fsm(regex), random.Random(data.draw(st.integers(0, 9))))
        assert re.search(pattern, json.loads(text)), (regex, text)


@functools.cache
def _fsm(regex: str) -> Any:
    return interegular.parse_pattern(regex).to_fsm()


def test_dates() -> None:
    regex = json_schema_to_regex({"type": "string", "format": "date"})
    for day in ["2024-02-29", "2000-02-29", "1999-12-31", "0001-01-01", "2023-04-30"]:
        assert re.fullmatch(regex, f'"{day}"'), day
    for day in ["2023-02-29", "1900-02-29", "2024-04-31", "0000-01-01", "2024-13-01", "24-1-1"]:
        assert not re.fullmatch(regex, f'"{day}"'), day
    rng = random.Random(1)
    fsm = interegular.parse_pattern(regex).to_fsm()
    for _ in range(300):
        dt.date.fromisoformat(json.loads(random_walk(fsm, rng)))


# ---------------------------------------------------------------- (d) errors and API

@pytest.mark.parametrize("schema, message", [
    ('{"type": "object",', "not valid JSON"),
    ({"type": "strin"}, "unknown type 'strin'"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if'"),
    ({"not": {"type": "null"}}, "'not'"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"$ref": "https://example.com/s.json"}, "local"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"type": "string", "pattern": "(a)\\1"}, "backreference"),
    ({"type": "string", "pattern": "a(?=b)"}, "lookaround"),
    ({"type": "string", "pattern": "a\\bc"}, "anchor"),
    ({"type": "string", "pattern": "(?i)abc"}, "flag"),
    ({"type": "string", "pattern": "[a-"}, "not a valid regex"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "cannot be combined"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'b' is not in"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "'type'"),
    ({"type": "string", "minLength": -1}, "minLength"),
    ({"type": "boolean", "enum": []}, "no JSON document"),
    (42, "object or a boolean"),
])
def test_invalid_schemas(schema: Any, message: str) -> None:
    with pytest.raises(InvalidSchemaError, match=re.escape(message)):
        json_schema_to_regex(schema)
    assert issubclass(InvalidSchemaError, ValueError)


def test_inputs_and_keywords() -> None:
    as_dict = json_schema_to_regex(Character.model_json_schema())
    assert json_schema_to_regex(Character) == as_dict
    assert json_schema_to_regex(json.dumps(Character.model_json_schema())) == as_dict
    assert re.fullmatch(json_schema_to_regex(True), "[1, {}]")
    assert re.fullmatch(json_schema_to_regex({"allOf": [{"type": "string"}, {"maxLength": 1}]}),
                        '"a"')
    merged = json_schema_to_regex({"anyOf": [{"maxLength": 1}, {"minLength": 3}],
                                   "type": "string"})
    assert re.fullmatch(merged, '"a"') and not re.fullmatch(merged, '"ab"')
    assert re.fullmatch(json_schema_to_regex({"type": "object"}), '{"a": [1, {"b": null}]}')
    assert re.fullmatch(json_schema_to_regex({"type": "array", "maxItems": 0}), "[]")
    assert not re.fullmatch(json_schema_to_regex({"type": "integer"}), "1.0")
    with pytest.raises(ValueError, match="whitespace"):
        json_schema_to_regex({}, whitespace="(")


def test_json_dtype_regexes() -> None:
    """JSON's spellings of the Python types (the DSL's `gen(dtype=)` uses SGLang's own regexes,
    which differ: `True|False`, trailing whitespace after numbers)."""
    for dtype in (int, float, bool, str):
        assert dtype_regex(dtype.__name__) == dtype_regex(dtype)
    assert re.fullmatch(dtype_regex(int), "-12") and re.fullmatch(dtype_regex(float), "1.5e3")
    assert re.fullmatch(dtype_regex(str), '"a\\"b"') and re.fullmatch(dtype_regex(bool), "true")
    with pytest.raises(ValueError):
        dtype_regex(list)


def test_regexes_compile_quickly_with_both_engines() -> None:
    sizes = {}
    for name in SCHEMAS:
        for whitespace in (None, FLEXIBLE) if name in FLEX_WALKED else (None,):
            regex = regex_of(name, whitespace)
            re.compile(regex)
            assert not re.search(r"\(\?[=!<]|\\[1-9]|[*+?}]\?", regex), name
            sizes[name, whitespace] = len(fsm_of(name, whitespace).states)
    assert max(sizes.values()) < 20_000, sizes


def test_enum_literals_keep_layout() -> None:
    regex = json_schema_to_regex(SCHEMAS["const_enum"], whitespace="")
    assert re.fullmatch(regex, '{"v":{"k":[1,"x",null],"é":2.5},"w":"naïve"}')
    assert re.fullmatch(json_schema_to_regex({"enum": [[1, 2]]}), "[1, 2]")
    assert not re.fullmatch(json_schema_to_regex({"enum": [[1, 2]]}), "[1,2]")
