r"""JSON Schema -> regex, for constrained decoding of JSON documents.

`json_schema_to_regex(schema)` returns a regex (Python `re` syntax that interegular also parses:
groups, alternation, character classes, greedy quantifiers only) whose full matches are JSON texts
valid for the schema. Conventions:

- Layout. `whitespace=None` is the canonical form of `json.dumps(value, ensure_ascii=False)`:
  `{"a": 1, "b": [1, 2]}`, ", " and ": " separators, nothing inside the brackets. Any other value
  is a regex (e.g. `r"[ \n\t]{0,2}"`, or "" for `{"a":1}`) put on both sides of each "," and
  ":" and inside the brackets, never around the whole document; it must match only JSON
  whitespace.
- Objects list `properties` in schema order; optional ones may be left out. Unlisted properties
  are never generated (`additionalProperties: false` is assumed when `properties` is given). An
  object without `properties` is a map from any string to `additionalProperties` values.
- Strings: raw UTF-8 or JSON escapes (`\"`, `\\`, `\n`, `\uXXXX`; a surrogate pair counts as
  one character); `minLength`/`maxLength` count decoded characters. `pattern` becomes a regex
  over the JSON text of the strings whose decoded value it matches with JSON Schema's search
  semantics (a side without `^`/`$` may hold anything). Its syntax and classes are Python `re`'s,
  `$` is ECMA-262's (only the very end); there non-ASCII characters are accepted raw only.
  `format` date, date-time, time (RFC 3339, upper-case "T"/"Z", no leap second), email and uuid
  are enforced; other formats are annotations.
- Numbers: `minimum`/`maximum`/`exclusive*` hold for the text and for its double (parsed
  rounding to nearest): past an exclusive bound's neighbouring double, or so small past an
  exclusive 0 that it parses to 0.0, no number is written (`0.99999999999999999999`, which
  parses to 1.0, is not below an exclusive 1). A bounded number is a plain decimal (no
  exponent) and an integer is never written `1.0`. `multipleOf` is rejected.
- `enum`/`const` match each value's canonical JSON (values of another `type` are dropped; other
  keywords beside them are not checked). `oneOf` is `anyOf` (branches assumed disjoint, as in
  pydantic unions). `allOf` items and `$ref` siblings are merged when they set different keywords.
- Size: linear in the schema with its `$ref`s expanded (never 2^n in the optional properties),
  except that commas cost copies: an array's item regex is written twice, and so are members
  2..n of an object with no required property, so each such level nests 2x or (2n-1)x.
- Bounds: a recursive `$ref` expands at most `max_recursion` times inside itself (past that the
  branch is dropped: an optional field is left out, a list stays empty); a free-form value (`{}`,
  `true`, `items` or `additionalProperties` left out) nests at most `any_depth` arrays/objects.

Keywords that change validation but cannot be expressed (`patternProperties`, `if`, `not`,
`uniqueItems: true`, ...) raise `InvalidSchemaError`; unknown keywords are ignored, as JSON Schema
says.
"""

from __future__ import annotations

import json
import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any
from urllib.parse import unquote

from lmnb.runtime.fsm.json_numbers import float_range, integer_range
from lmnb.runtime.fsm.json_pattern import PatternTranslator
from lmnb.runtime.fsm.json_text import STRING_CHAR, InvalidSchemaError
from lmnb.runtime.fsm.regex_text import alternatives, group, literal_text, repeat

STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(\.[0-9]+)?([eE][-+]?[0-9]+)?"
BOOLEAN = "(true|false)"
NULL = "null"

_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = ("((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)"
              "|(0[13578]|1[02])-31)")
_DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HOUR_MINUTE = "([01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = rf"{_HOUR_MINUTE}:[0-5][0-9](\.[0-9]+)?(Z|[-+]{_HOUR_MINUTE})"
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_HEX = "[0-9a-fA-F]"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "email": rf"{_ATOM}(\.{_ATOM})*@{_LABEL}(\.{_LABEL})+",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
}

_DTYPE_REGEXES: dict[type, str] = {
    int: r"[-+]?(0|[1-9][0-9]*)",
    float: r"[-+]?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?",
    bool: r"(true|false)",
    str: r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"',
}
_DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str}

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$anchor", "$comment",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "discriminator",
    "contentEncoding", "contentMediaType", "contentSchema", "$vocabulary",
})
_UNSUPPORTED = frozenset({
    "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
    "dependencies", "if", "then", "else", "not", "unevaluatedProperties", "unevaluatedItems",
    "contains", "minContains", "maxContains", "multipleOf", "$dynamicRef", "$recursiveRef",
})
_TYPE_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties", "minProperties",
               "maxProperties"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
}


def json_schema_to_regex(
    schema: dict | str | bool | type,
    *,
    whitespace: str | None = None,
    max_recursion: int = 3,
    any_depth: int = 2,
) -> str:
    """A regex whose full matches are the JSON texts valid for `schema` (a dict, its JSON text,
    or a pydantic model class), laid out as the module docstring describes."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidSchemaError(f"schema is not valid JSON: {e}") from None
    elif isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if not isinstance(schema, dict | bool):
        raise InvalidSchemaError(f"a schema must be an object or a boolean, got {schema!r}")
    if whitespace is not None:
        try:
            re.compile(whitespace)
        except re.error as e:
            raise ValueError(f"whitespace is not a valid regex: {e}") from None
    regex = _Builder(schema, whitespace=whitespace, max_recursion=max_recursion,
                     any_depth=any_depth).build(schema)
    if regex is None:
        raise InvalidSchemaError(
            "no JSON document satisfies the schema (within the recursion bound "
            f"max_recursion={max_recursion})")
    return regex


def dtype_regex(dtype: type | str) -> str:
    """The regex of `gen(dtype=...)` for int, float, bool or str (same as lmnb.lang's)."""
    kind = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if kind not in _DTYPE_REGEXES:
        raise ValueError(f"dtype must be one of int, float, bool, str; got {dtype!r}")
    return _DTYPE_REGEXES[kind]


def _json_type_of(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


class _Builder:
    def __init__(self, root: dict | bool, *, whitespace: str | None, max_recursion: int,
                 any_depth: int) -> None:
        self.root = root
        self.max_recursion = max_recursion
        self.any_depth = any_depth
        self.pad = f"({whitespace})" if whitespace else ""
        self.sep = ", " if whitespace is None else f"{self.pad},{self.pad}"
        self.colon = ": " if whitespace is None else f"{self.pad}:{self.pad}"
        self.expanding: dict[str, int] = {}
        self.any_cache: dict[int, str] = {}
        self.types = {"null": self._null, "boolean": self._boolean, "integer": self._integer,
                      "number": self._number, "string": self._string, "array": self._array,
                      "object": self._object}

    def build(self, schema: Any) -> str | None:
        """Regex of the documents valid for `schema`; None when there are none."""
        if schema is True:
            return self._any(self.any_depth)
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise InvalidSchemaError(f"a schema must be an object or a boolean, got {schema!r}")
        unsupported = sorted(_UNSUPPORTED.intersection(schema))
        if unsupported:
            raise InvalidSchemaError(f"unsupported keyword {unsupported[0]!r}")
        if "$ref" in schema:
            return self._ref(schema)
        if "allOf" in schema:
            return self._all_of(schema)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                return self._union(schema, keyword)
        if "enum" in schema or "const" in schema:
            return self._enum(schema)
        types = self._types(schema)
        if types is None:
            return self._any(self.any_depth)
        return alternatives([self.types[name](schema) for name in types])

    def _types(self, schema: dict) -> list[str] | None:
        declared = schema.get("type")
        if declared is None:
            inferred = [name for name, keys in _TYPE_KEYWORDS.items() if keys & schema.keys()]
            return inferred or None
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names:
            raise InvalidSchemaError(f"'type' must be a name or a non-empty list, got {declared!r}")
        for name in names:
            if name not in self.types:
                raise InvalidSchemaError(f"unknown type {name!r} in 'type'")
        if "integer" in names and "number" in names:
            names = [name for name in names if name != "integer"]
        return names

    def _resolve(self, ref: Any) -> Any:
        """A local `$ref`: a JSON pointer in a URI fragment ('#/$defs/a%20b': percent-decoded,
        then '~1' and '~0' unescaped), or a plain-name fragment naming an `$anchor` ('#node')."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InvalidSchemaError(f"only local '$ref's ('#/$defs/...') are supported: {ref!r}")
        fragment = unquote(ref[1:])
        if fragment and not fragment.startswith("/"):
            return self._anchor(fragment, ref)
        node: Any = self.root
        for part in fragment.split("/")[1:] if fragment not in ("", "/") else []:
            key = part.replace("~1", "/").replace("~0", "~")
            try:
                node = node[int(key)] if isinstance(node, list) else node[key]
            except (KeyError, IndexError, ValueError, TypeError):
                raise InvalidSchemaError(f"'$ref' {ref!r} does not resolve") from None
        return node

    def _anchor(self, name: str, ref: str) -> Any:
        """The subschema whose `$anchor` is `name` (or, in drafts before 2019-09, whose `$id`
        is '#name')."""
        pending: list[Any] = [self.root]
        while pending:
            node = pending.pop()
            if isinstance(node, dict):
                if node.get("$anchor") == name or node.get("$id") == f"#{name}":
                    return node
                pending.extend(node.values())
            elif isinstance(node, list):
                pending.extend(node)
        raise InvalidSchemaError(f"'$ref' {ref!r} names no '$anchor' of the schema")

    def _ref(self, schema: dict) -> str | None:
        ref = schema["$ref"]
        target = self._resolve(ref)
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        if target is True:
            target = {}
        if isinstance(target, dict) and set(siblings) - _ANNOTATIONS:
            target = _merge(target, siblings, where=f"'$ref' {ref!r}")
        return self._expand(target, [ref])

    def _expand(self, schema: Any, refs: list[str]) -> str | None:
        """`schema`, reached through `refs`, each counted against `max_recursion`."""
        if any(self.expanding.get(ref, 0) >= self.max_recursion for ref in refs):
            return None
        for ref in refs:
            self.expanding[ref] = self.expanding.get(ref, 0) + 1
        try:
            return self.build(schema)
        finally:
            for ref in refs:
                self.expanding[ref] -= 1

    def _all_of(self, schema: dict) -> str | None:
        refs: list[str] = []
        merged = self._merge_all(schema, refs)
        return None if merged is None else self._expand(merged, list(dict.fromkeys(refs)))

    def _merge_all(self, schema: dict, refs: list[str]) -> dict | None:
        """`schema`'s `allOf` items merged into it; the `$ref`s inlined are added to `refs`."""
        items = schema["allOf"]
        if not isinstance(items, list) or not items:
            raise InvalidSchemaError("'allOf' must be a non-empty list")
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for item in items:
            seen: set[str] = set()
            while isinstance(item, dict) and "$ref" in item:
                if item["$ref"] in seen:
                    raise InvalidSchemaError(f"circular '$ref' {item['$ref']!r} in 'allOf'")
                seen.add(item["$ref"])
                refs.append(item["$ref"])
                target = self._resolve(item["$ref"])
                rest = {k: v for k, v in item.items() if k != "$ref"}
                item = _merge(target, rest, where="'allOf'") if isinstance(target, dict) else target
            if item is False:
                return None
            if item is not True:
                if not isinstance(item, dict):
                    raise InvalidSchemaError(f"'allOf' items must be schemas, got {item!r}")
                merged = _merge(merged, item, where="'allOf'")
        return merged

    def _union(self, schema: dict, keyword: str) -> str | None:
        branches = schema[keyword]
        if not isinstance(branches, list) or not branches:
            raise InvalidSchemaError(f"{keyword!r} must be a non-empty list")
        siblings = {k: v for k, v in schema.items() if k != keyword}
        if not set(siblings) - _ANNOTATIONS:
            return alternatives([self.build(branch) for branch in branches])
        regexes = []
        for branch in branches:
            if branch is True:
                branch = {}
            if isinstance(branch, dict):
                branch = _merge(siblings, branch, where=repr(keyword))
            regexes.append(self.build(branch))
        return alternatives(regexes)

    def _enum(self, schema: dict) -> str | None:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list):
            raise InvalidSchemaError("'enum' must be a list")
        if "const" in schema and "enum" in schema:
            values = [v for v in values if v == schema["const"]]
        if "type" in schema:
            allowed = set(self._types(schema) or ())
            if "number" in allowed:
                allowed.add("integer")
            values = [v for v in values if _json_type_of(v) & allowed]
        return alternatives([self._literal(v) for v in values])

    def _literal(self, value: Any) -> str:
        if isinstance(value, dict):
            members = [f"{self._literal(str(k))}{self.colon}{self._literal(v)}"
                       for k, v in value.items()]
            return self._container(r"\{", r"\}", self.sep.join(members) or None, optional=False)
        if isinstance(value, list):
            items = [self._literal(v) for v in value]
            return self._container(r"\[", r"\]", self.sep.join(items) or None, optional=False)
        try:
            return literal_text(json.dumps(value, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise InvalidSchemaError(f"not a JSON value in 'enum'/'const': {value!r}") from e

    def _container(self, open_: str, close: str, body: str | None, *, optional: bool) -> str:
        if body is None:
            return f"{open_}{self.pad}{close}"
        inner = f"{body}{self.pad}"
        return f"{open_}{self.pad}{f'({inner})?' if optional else inner}{close}"

    def _any(self, depth: int) -> str | None:
        if depth < 0:
            return None
        if depth not in self.any_cache:
            scalars = [STRING, NUMBER, "true", "false", NULL]
            if depth > 0:
                inner = self._any(depth - 1)
                scalars.append(self._array_of([], inner, 0, None))
                scalars.append(self._map(inner, 0, None))
            self.any_cache[depth] = alternatives(scalars)
        return self.any_cache[depth]

    def _null(self, schema: dict) -> str:
        return NULL

    def _boolean(self, schema: dict) -> str:
        return BOOLEAN

    def _integer(self, schema: dict) -> str | None:
        lo, lo_excl, hi, hi_excl = _bounds(schema)
        if lo is None and hi is None:
            return INTEGER
        lo_int = None if lo is None else (
            int(lo.to_integral_value(ROUND_FLOOR)) + 1 if lo_excl
            else int(lo.to_integral_value(ROUND_CEILING)))
        hi_int = None if hi is None else (
            int(hi.to_integral_value(ROUND_CEILING)) - 1 if hi_excl
            else int(hi.to_integral_value(ROUND_FLOOR)))
        return integer_range(lo_int, hi_int)

    def _number(self, schema: dict) -> str | None:
        lo, lo_excl, hi, hi_excl = _bounds(schema)
        if lo is None and hi is None:
            return NUMBER
        return float_range(lo, lo_excl, hi, hi_excl)

    def _string(self, schema: dict) -> str | None:
        lo = _count(schema, "minLength", 0)
        hi = _count(schema, "maxLength", None)
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if pattern is not None:
            if fmt in FORMATS or lo or hi is not None:
                raise InvalidSchemaError(
                    "'pattern' cannot be combined with 'format', 'minLength' or 'maxLength'")
            if not isinstance(pattern, str):
                raise InvalidSchemaError(f"'pattern' must be a string, got {pattern!r}")
            return f'"{PatternTranslator(pattern).regex()}"'
        if fmt in FORMATS:
            if lo or hi is not None:
                raise InvalidSchemaError(
                    f"'format' {fmt!r} cannot be combined with 'minLength' or 'maxLength'")
            return f'"{FORMATS[fmt]}"'
        if hi is not None and hi < lo:
            return None
        return STRING if (lo, hi) == (0, None) else f'"{repeat(STRING_CHAR, lo, hi)}"'

    def _array(self, schema: dict) -> str | None:
        if schema.get("uniqueItems") is True:
            raise InvalidSchemaError("unsupported keyword 'uniqueItems': true")
        lo, hi = _count(schema, "minItems", 0), _count(schema, "maxItems", None)
        prefix, rest = schema.get("prefixItems", []), schema.get("items", True)
        if isinstance(rest, list):
            prefix, rest = rest, schema.get("additionalItems", True)
        if not isinstance(prefix, list):
            raise InvalidSchemaError("'prefixItems' must be a list of schemas")
        if hi is not None:
            prefix = prefix[:hi]
        prefix_regexes = [self.build(item) for item in prefix]
        rest_regex = self.build(rest)
        return self._array_of(prefix_regexes, rest_regex, lo, hi)

    def _array_of(self, prefix: list[str | None], rest: str | None, lo: int,
                  hi: int | None) -> str | None:
        """`[` prefix items (each may be the last), then `rest` items, `lo` to `hi` in all `]`."""
        if hi is not None and hi < lo:
            return None
        for i, item in enumerate(prefix):
            if item is None:
                if i < lo:
                    return None
                prefix, hi = prefix[:i], i
                break
        rest_lo = max(0, lo - len(prefix))
        rest_hi = None if hi is None else max(0, hi - len(prefix))
        if rest is None or rest_hi == 0:
            if rest_lo > 0:
                return None
            rest, rest_hi = None, 0
        if not prefix:
            if rest is None:
                return self._container(r"\[", r"\]", None, optional=True)
            rest = group(rest)
            body = rest + repeat(f"{self.sep}{rest}", max(rest_lo - 1, 0),
                                  None if rest_hi is None else rest_hi - 1)
            return self._container(r"\[", r"\]", body, optional=rest_lo == 0)
        tail = "" if rest is None else repeat(f"{self.sep}{group(rest)}", rest_lo, rest_hi)
        for position in range(len(prefix) - 1, 0, -1):
            segment = f"{self.sep}{group(prefix[position])}{tail}"
            tail = segment if position < lo else f"({segment})?"
        return self._container(r"\[", r"\]", group(prefix[0]) + tail, optional=lo == 0)

    def _object(self, schema: dict) -> str | None:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise InvalidSchemaError("'properties' must be an object and 'required' a list")
        for name in required:
            if name not in properties:
                raise InvalidSchemaError(
                    f"required property {name!r} is not in 'properties' (additional properties "
                    "are not generated)")
        if "properties" not in schema:
            lo, hi = _count(schema, "minProperties", 0), _count(schema, "maxProperties", None)
            values = schema.get("additionalProperties", True)
            value = self.build(values)
            return self._map(value, lo, hi)
        for keyword in ("minProperties", "maxProperties"):
            if keyword in schema:
                raise InvalidSchemaError(f"unsupported keyword {keyword!r} with 'properties'")
        members: list[tuple[str, bool]] = []
        for name, sub in properties.items():
            value = self.build(sub)
            if value is None:
                if name in required:
                    return None
                continue
            key = literal_text(json.dumps(name, ensure_ascii=False))
            members.append((f"{key}{self.colon}{group(value)}", name in required))
        return self._members(members)

    def _members(self, members: list[tuple[str, bool]]) -> str:
        """Comma-separated members in order; optional ones may be left out. With a required
        member, each member is written once: those before the first required one carry a trailing
        separator, those after it a leading one. With none required, F(k) = (F(k-1)(, m_k)?|m_k)
        (any non-empty subset in order) writes members 2..n twice."""
        first = next((i for i, (_, req) in enumerate(members) if req), None)
        if first is None:
            body = None
            for member, _ in members:
                body = f"({member})" if body is None else f"({body}({self.sep}{member})?|{member})"
            return self._container(r"\{", r"\}", body, optional=True)
        parts = [f"({member}{self.sep})?" for member, _ in members[:first]]
        parts.append(members[first][0])
        for member, req in members[first + 1:]:
            parts.append(f"{self.sep}{member}" if req else f"({self.sep}{member})?")
        return self._container(r"\{", r"\}", "".join(parts), optional=False)

    def _map(self, value: str | None, lo: int, hi: int | None) -> str | None:
        if hi is not None and hi < lo:
            return None
        if value is None or hi == 0:
            return None if lo > 0 else self._container(r"\{", r"\}", None, optional=True)
        entry = f"{STRING}{self.colon}{group(value)}"
        body = entry + repeat(f"{self.sep}{entry}", max(lo - 1, 0), None if hi is None else hi - 1)
        return self._container(r"\{", r"\}", body, optional=lo == 0)


def _merge(base: dict, other: dict, *, where: str) -> dict:
    merged = dict(base)
    for key, value in other.items():
        if key in merged and key not in _ANNOTATIONS and merged[key] != value:
            raise InvalidSchemaError(f"{where}: cannot combine two different {key!r} constraints")
        merged[key] = value
    return merged


def _count(schema: dict, keyword: str, default: int | None) -> int | None:
    value = schema.get(keyword, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or value < 0 or value != int(value)):
        raise InvalidSchemaError(f"{keyword!r} must be a non-negative integer, got {value!r}")
    return None if value is None else int(value)


def _decimal(schema: dict, keyword: str) -> Decimal | None:
    value = schema.get(keyword)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value \
            or value in (float("inf"), float("-inf")):
        raise InvalidSchemaError(f"{keyword!r} must be a finite number, got {value!r}")
    return Decimal(value) if isinstance(value, int) else Decimal(repr(value))


def _bounds(schema: dict) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """(lower, lower is exclusive, upper, upper is exclusive), from drafts 4 to 2020-12."""
    bounds = []
    for inclusive, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        value, flag = _decimal(schema, inclusive), schema.get(exclusive)
        if isinstance(flag, bool):
            bounds.append((value, flag and value is not None))
            continue
        strict = _decimal(schema, exclusive)
        stricter = strict is not None and (
            value is None or (strict >= value if inclusive == "minimum" else strict <= value))
        if stricter:
            bounds.append((strict, True))
        else:
            bounds.append((value, False))
    (lo, lo_excl), (hi, hi_excl) = bounds
    return lo, lo_excl, hi, hi_excl
