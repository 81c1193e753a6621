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
- Numbers: `minimum`/`maximum`/`exclusive*` are exact; a bounded number is a plain decimal (no
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
import sys
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

if sys.version_info >= (3, 11):
    from re import _parser as _sre
else:  # pragma: no cover
    import sre_parse as _sre


class InvalidSchemaError(ValueError):
    """The schema is malformed or uses a keyword this translation cannot express."""


_NON_SURROGATE = r"[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}"
_SURROGATE_PAIR = r"[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_BAD = r'"\\\x00-\x1f'  # class text of the characters a JSON string cannot hold raw
STRING_CHAR = rf'([^{_BAD}]|\\(["\\/bfnrt]|u({_NON_SURROGATE}|{_SURROGATE_PAIR})))'
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
_REGEX_SPECIALS = frozenset("\\.^$*+?{}[]|()")


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


def _group(regex: str) -> str:
    return f"({regex})" if "|" in regex else regex


def _alternatives(regexes: list[str | None]) -> str | None:
    kept = list(dict.fromkeys(r for r in regexes if r is not None))
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else "(" + "|".join(kept) + ")"


def _repeat(regex: str, lo: int, hi: int | None) -> str:
    if hi == 0:
        return ""
    quantifier = {(0, None): "*", (1, None): "+", (0, 1): "?", (1, 1): ""}.get((lo, hi))
    if quantifier is None:
        quantifier = f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"
    if not quantifier:
        return regex
    atom = regex if re.fullmatch(r"\[[^\]]*\]|\\?.", regex) else f"({regex})"
    return atom + quantifier


def _literal_text(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIALS else c for c in text)


def _class_char(c: str) -> str:
    code = ord(c)
    if code < 0x20 or 0x7F <= code <= 0x9F:
        return f"\\x{code:02x}"
    return "\\" + c if c in "\\]^-[&~|" else c


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
            merged = self._merge_all(schema)
            return None if merged is None else self.build(merged)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                return self._union(schema, keyword)
        if "enum" in schema or "const" in schema:
            return self._enum(schema)
        types = self._types(schema)
        if types is None:
            return self._any(self.any_depth)
        return _alternatives([self.types[name](schema) for name in types])

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
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InvalidSchemaError(f"only local '$ref's ('#/$defs/...') are supported: {ref!r}")
        node: Any = self.root
        for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else []:
            key = part.replace("~1", "/").replace("~0", "~")
            try:
                node = node[int(key)] if isinstance(node, list) else node[key]
            except (KeyError, IndexError, ValueError, TypeError):
                raise InvalidSchemaError(f"'$ref' {ref!r} does not resolve") from None
        return node

    def _ref(self, schema: dict) -> str | None:
        ref = schema["$ref"]
        target = self._resolve(ref)
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        if target is True:
            target = {}
        if self.expanding.get(ref, 0) >= self.max_recursion:
            return None
        self.expanding[ref] = self.expanding.get(ref, 0) + 1
        try:
            if isinstance(target, dict) and set(siblings) - _ANNOTATIONS:
                return self.build(_merge(target, siblings, where=f"'$ref' {ref!r}"))
            return self.build(target)
        finally:
            self.expanding[ref] -= 1

    def _merge_all(self, schema: dict) -> dict | None:
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
            return _alternatives([self.build(branch) for branch in branches])
        regexes = []
        for branch in branches:
            if branch is True:
                branch = {}
            if isinstance(branch, dict):
                branch = _merge(siblings, branch, where=repr(keyword))
            regexes.append(self.build(branch))
        return _alternatives(regexes)

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
        return _alternatives([self._literal(v) for v in values])

    def _literal(self, value: Any) -> str:
        if isinstance(value, dict):
            members = [f"{self._literal(str(k))}{self.colon}{self._literal(v)}"
                       for k, v in value.items()]
            return self._container(r"\{", r"\}", self.sep.join(members) or None, optional=False)
        if isinstance(value, list):
            items = [self._literal(v) for v in value]
            return self._container(r"\[", r"\]", self.sep.join(items) or None, optional=False)
        try:
            return _literal_text(json.dumps(value, ensure_ascii=False, allow_nan=False))
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
            self.any_cache[depth] = _alternatives(scalars)
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
        return _integer_range(lo_int, hi_int)

    def _number(self, schema: dict) -> str | None:
        lo, lo_excl, hi, hi_excl = _bounds(schema)
        if lo is None and hi is None:
            return NUMBER
        return _decimal_range(lo, lo_excl, hi, hi_excl)

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
            return f'"{_PatternTranslator(pattern).regex()}"'
        if fmt in FORMATS:
            if lo or hi is not None:
                raise InvalidSchemaError(
                    f"'format' {fmt!r} cannot be combined with 'minLength' or 'maxLength'")
            return f'"{FORMATS[fmt]}"'
        if hi is not None and hi < lo:
            return None
        return STRING if (lo, hi) == (0, None) else f'"{_repeat(STRING_CHAR, lo, hi)}"'

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
            rest = _group(rest)
            body = rest + _repeat(f"{self.sep}{rest}", max(rest_lo - 1, 0),
                                  None if rest_hi is None else rest_hi - 1)
            return self._container(r"\[", r"\]", body, optional=rest_lo == 0)
        tail = "" if rest is None else _repeat(f"{self.sep}{_group(rest)}", rest_lo, rest_hi)
        for position in range(len(prefix) - 1, 0, -1):
            segment = f"{self.sep}{_group(prefix[position])}{tail}"
            tail = segment if position < lo else f"({segment})?"
        return self._container(r"\[", r"\]", _group(prefix[0]) + tail, optional=lo == 0)

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
            key = _literal_text(json.dumps(name, ensure_ascii=False))
            members.append((f"{key}{self.colon}{_group(value)}", name in required))
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
        entry = f"{STRING}{self.colon}{_group(value)}"
        body = entry + _repeat(f"{self.sep}{entry}", max(lo - 1, 0), None if hi is None else hi - 1)
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


def _digit_class(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _same_length_range(lo: str, hi: str) -> str:
    """Digit strings of one length between `lo` and `hi` inclusive."""
    if lo == hi:
        return lo
    n = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + _group(_same_length_range(lo[1:], hi[1:]))
    parts, first, last = [], int(lo[0]), int(hi[0])
    if lo[1:] != "0" * n:
        parts.append(lo[0] + _group(_same_length_range(lo[1:], "9" * n)))
        first += 1
    tail = None
    if hi[1:] != "9" * n:
        tail = hi[0] + _group(_same_length_range("0" * n, hi[1:]))
        last -= 1
    if first <= last:
        parts.append(_digit_class(first, last) + _repeat("[0-9]", n, n))
    if tail is not None:
        parts.append(tail)
    return "|".join(parts)


def _natural_range(lo: int, hi: int | None) -> str | None:
    """Decimal naturals (no leading zeros) in [lo, hi]; hi None is unbounded."""
    if hi is not None and hi < lo:
        return None
    low, high = str(lo), None if hi is None else str(hi)
    if high is not None and len(high) == len(low):
        return _group(_same_length_range(low, high))
    parts = [_same_length_range(low, "9" * len(low))]
    longer = len(low) + 1
    if high is None:
        parts.append(f"[1-9][0-9]{{{longer - 1},}}")
    else:
        if len(high) > longer:
            parts.append("[1-9]" + _repeat("[0-9]", longer - 1, len(high) - 2))
        parts.append(_same_length_range("1" + "0" * (len(high) - 1), high))
    return "(" + "|".join(parts) + ")"


def _integer_range(lo: int | None, hi: int | None) -> str | None:
    """Integers in [lo, hi] (None: unbounded), without "-0"."""
    positive = None
    if hi is None or hi >= 0:
        positive = _natural_range(max(lo, 0) if lo is not None else 0, hi)
    negative = None
    if lo is None or lo < 0:
        magnitude = _natural_range(max(-hi, 1) if hi is not None else 1,
                                   None if lo is None else -lo)
        negative = None if magnitude is None else "-" + magnitude
    return _alternatives([positive, negative])


def _split(value: Decimal) -> tuple[int, str]:
    """Non-negative decimal -> (integer part, fraction digits without trailing zeros)."""
    whole, _, fraction = format(value, "f").partition(".")
    return int(whole), fraction.rstrip("0")


def _fraction(lo: str | None, lo_excl: bool, hi: str | None, hi_excl: bool
              ) -> tuple[str | None, bool]:
    """Digit strings R (read as 0.R) within the bounds: (regex of the non-empty ones, whether the
    empty one is allowed). Bounds are digit strings without trailing zeros; None is unbounded."""
    empty = (lo is None or (lo == "" and not lo_excl)) and (hi != "" or not hi_excl)
    if hi is None and lo == "" and lo_excl:
        return "0*[1-9][0-9]*", False
    if lo is None or (lo == "" and not lo_excl):
        if hi is None:
            return "[0-9]+", empty
        lo, lo_excl = "", False
        if hi == "":
            return (None if hi_excl else "0+"), empty
    if hi is not None and hi == "":
        return None, empty
    first_lo, rest_lo = (lo[0], lo[1:]) if lo else ("0", "")
    first_hi = None if hi is None else hi[0]
    parts: list[str | None] = []

    def follow(digit: str, *bounds: Any) -> str | None:
        regex, may_end = _fraction(*bounds)
        if regex is None:
            return digit if may_end else None
        return digit + (f"({regex})?" if may_end else _group(regex))

    if first_hi is None or first_lo < first_hi:
        parts.append(follow(first_lo, rest_lo, lo_excl, None, False))
        top = 9 if first_hi is None else int(first_hi) - 1
        if int(first_lo) + 1 <= top:
            parts.append(_digit_class(int(first_lo) + 1, top) + "[0-9]*")
        if first_hi is not None:
            parts.append(follow(first_hi, "", False, hi[1:], hi_excl))
    elif first_lo == first_hi:
        parts.append(follow(first_lo, rest_lo, lo_excl, hi[1:], hi_excl))
    kept = [p for p in parts if p is not None]
    return ("|".join(kept) if kept else None), empty


def _magnitude_range(lo: Decimal, lo_excl: bool, hi: Decimal | None, hi_excl: bool
                     ) -> str | None:
    """Plain decimals m >= 0 (`I` or `I.F`) between the bounds, lo >= 0."""
    lo_int, lo_frac = _split(lo)
    hi_int, hi_frac = (None, None) if hi is None else _split(hi)

    def with_fraction(whole: int, *bounds: Any) -> str | None:
        regex, may_end = _fraction(*bounds)
        if regex is None:
            return str(whole) if may_end else None
        dotted = rf"\.({regex})"
        return str(whole) + (f"({dotted})?" if may_end else dotted)

    if hi_int is not None and hi_int < lo_int:
        return None
    if hi_int == lo_int:
        return with_fraction(lo_int, lo_frac, lo_excl, hi_frac, hi_excl)
    parts = [with_fraction(lo_int, lo_frac, lo_excl, None, False)]
    middle = _natural_range(lo_int + 1, None if hi_int is None else hi_int - 1)
    if middle is not None:
        parts.append(middle + r"(\.[0-9]+)?")
    if hi_int is not None:
        parts.append(with_fraction(hi_int, "", False, hi_frac, hi_excl))
    return _alternatives(parts)


def _decimal_range(lo: Decimal | None, lo_excl: bool, hi: Decimal | None, hi_excl: bool
                   ) -> str | None:
    """Plain decimals (no exponent) within the bounds; "-0" / "-0.0" count as zero."""
    zero = Decimal(0)
    positive = None
    if hi is None or hi >= 0:
        low, low_excl = (lo, lo_excl) if lo is not None and lo >= 0 else (zero, False)
        positive = _magnitude_range(low, low_excl, hi, hi_excl)
    negative = None
    if lo is None or lo <= 0:
        low, low_excl = (-hi, hi_excl) if hi is not None and hi <= 0 else (zero, False)
        magnitude = _magnitude_range(low, low_excl, None if lo is None else -lo, lo_excl)
        negative = None if magnitude is None else "-" + _group(magnitude)
    return _alternatives([positive, negative])


_CATEGORIES = {
    _sre.CATEGORY_DIGIT: r"\d", _sre.CATEGORY_NOT_DIGIT: r"\D",
    _sre.CATEGORY_SPACE: r"\s", _sre.CATEGORY_NOT_SPACE: r"\S",
    _sre.CATEGORY_WORD: r"\w", _sre.CATEGORY_NOT_WORD: r"\W",
}
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
_NEEDS_ESCAPE = ['"', "\\"] + [chr(i) for i in range(0x20)]
_BAD_INTERVALS = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_STARTS = (_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING)
_ENDS = (_sre.AT_END, _sre.AT_END_STRING)


class _PatternTranslator:
    """A `pattern` (a regex over the decoded string) -> a regex over the string's JSON text."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def fail(self, what: str) -> InvalidSchemaError:
        return InvalidSchemaError(f"'pattern' {self.pattern!r}: {what} is not supported")

    def regex(self) -> str:
        try:
            parsed = _sre.parse(self.pattern)
        except re.error as e:
            raise InvalidSchemaError(f"'pattern' {self.pattern!r} is not a valid regex: {e}"
                                     ) from None
        if parsed.state.flags & ~int(re.UNICODE):
            raise self.fail("an inline flag")
        return self.anchored(list(parsed), start=False, end=False)

    def anchored(self, items: list, *, start: bool, end: bool) -> str:
        while items and items[0][0] is _sre.AT and items[0][1] in _STARTS:
            start, items = True, items[1:]
        while items and items[-1][0] is _sre.AT and items[-1][1] in _ENDS:
            end, items = True, items[:-1]
        if len(items) == 1:
            op, arg = items[0]
            if op is _sre.BRANCH:
                return "(" + "|".join(self.anchored(list(alt), start=start, end=end)
                                      for alt in arg[1]) + ")"
            if op is _sre.SUBPATTERN and not arg[1] and not arg[2]:
                return self.anchored(list(arg[3]), start=start, end=end)
        body = self.sequence(items)
        if not body and not (start and end):
            return STRING_CHAR + "*"
        return ("" if start else STRING_CHAR + "*") + body + ("" if end else STRING_CHAR + "*")

    def sequence(self, items: Any) -> str:
        return "".join(self.item(op, arg) for op, arg in items)

    def item(self, op: Any, arg: Any) -> str:
        if op is _sre.LITERAL:
            return self.char(chr(arg))
        if op is _sre.NOT_LITERAL:
            return self.charset([(_sre.LITERAL, arg)], negate=True)
        if op is _sre.ANY:
            return self.charset([(_sre.LITERAL, ord("\n"))], negate=True)
        if op is _sre.IN:
            negate = bool(arg) and arg[0][0] is _sre.NEGATE
            return self.charset(arg[1:] if negate else arg, negate=negate)
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):
            lo, hi, sub = arg
            return _repeat(self.sequence(sub), lo, None if hi == _sre.MAXREPEAT else hi)
        if op is _sre.SUBPATTERN:
            if arg[1] or arg[2]:
                raise self.fail("an inline flag")
            return f"({self.sequence(arg[3])})"
        if op is _sre.BRANCH:
            return "(" + "|".join(self.sequence(alt) for alt in arg[1]) + ")"
        names = {_sre.AT: "an anchor inside the pattern or '\\b'", _sre.ASSERT: "a lookaround",
                 _sre.ASSERT_NOT: "a lookaround", _sre.GROUPREF: "a backreference",
                 _sre.GROUPREF_EXISTS: "a conditional group"}
        raise self.fail(names.get(op, f"{str(op).lower()!r}"))

    def char(self, c: str) -> str:
        if c in _NEEDS_ESCAPE:
            return _escapes([c])
        return _literal_text(c)

    def charset(self, items: list, *, negate: bool) -> str:
        def member(c: str) -> bool:
            return any(_set_item_contains(op, arg, c) for op, arg in items) != negate

        raw: list[str] = []
        if negate:
            raw.append("[^" + "".join(_set_item_text(op, arg) for op, arg in items) + _BAD + "]")
        else:
            intervals = []
            for op, arg in items:
                if op is _sre.LITERAL:
                    intervals.append((arg, arg))
                elif op is _sre.RANGE:
                    intervals.append(arg)
                elif op is _sre.CATEGORY:
                    raw.append("[^" + _CATEGORIES[arg].swapcase() + _BAD + "]")
                else:
                    raise self.fail(f"{str(op).lower()!r} in a character class")
            allowed = _subtract(intervals, _BAD_INTERVALS)
            if allowed:
                raw.insert(0, "[" + "".join(_class_char(chr(a)) if a == b else
                                            f"{_class_char(chr(a))}-{_class_char(chr(b))}"
                                            for a, b in allowed) + "]")
        escaped = [c for c in _NEEDS_ESCAPE if member(c)]
        options = raw + ([_escapes(escaped)] if escaped else [])
        if not options:
            raise self.fail("a character class that matches no string character")
        return options[0] if len(options) == 1 else "(" + "|".join(options) + ")"


def _set_item_contains(op: Any, arg: Any, c: str) -> bool:
    if op is _sre.LITERAL:
        return ord(c) == arg
    if op is _sre.RANGE:
        return arg[0] <= ord(c) <= arg[1]
    return op is _sre.CATEGORY and re.fullmatch(_CATEGORIES[arg], c) is not None


def _set_item_text(op: Any, arg: Any) -> str:
    if op is _sre.LITERAL:
        return _class_char(chr(arg))
    if op is _sre.RANGE:
        return f"{_class_char(chr(arg[0]))}-{_class_char(chr(arg[1]))}"
    return _CATEGORIES[arg]


def _subtract(intervals: list[tuple[int, int]], holes: list[tuple[int, int]]
              ) -> list[tuple[int, int]]:
    """Code-point intervals minus sorted, disjoint `holes`."""
    result = []
    for lo, hi in sorted(intervals):
        for hole_lo, hole_hi in holes:
            if hole_hi < lo or hole_lo > hi:
                continue
            if hole_lo > lo:
                result.append((lo, hole_lo - 1))
            lo = hole_hi + 1
        if lo <= hi:
            result.append((lo, hi))
    return result


def _escapes(chars: list[str]) -> str:
    """JSON escape sequences of `chars` (each must need escaping): short form where there is
    one, else `\\u00XX` in either case."""
    options = []
    short = [_SHORT_ESCAPES[c] for c in chars if c in _SHORT_ESCAPES]
    if short:
        options.append("\\\\" + ("[" + "".join(_class_char(s) for s in short) + "]"
                                 if len(short) > 1 else _literal_text(short[0])))
    coded = [ord(c) for c in chars if c not in _SHORT_ESCAPES]
    for high in (0, 1):
        lows = [code & 0xF for code in coded if code >> 4 == high]
        if lows:
            digits = "".join(f"{low:x}{low:X}" if low > 9 else str(low) for low in lows)
            options.append(f"\\\\u00{high}[{digits}]")
    return options[0] if len(options) == 1 else "(" + "|".join(options) + ")"
