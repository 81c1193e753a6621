"""A JSON string's characters as regex text, and the error of a schema the translation to a regex
cannot express (shared by `json_schema` and the string `pattern` translation, `json_pattern`)."""

from __future__ import annotations


class InvalidSchemaError(ValueError):
    """The schema is malformed or uses a keyword this translation cannot express."""


_NON_SURROGATE = r"[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}"
_SURROGATE_PAIR = r"[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
RAW_EXCLUDED = r'"\\\x00-\x1f'  # class text of the characters a JSON string cannot hold raw
STRING_CHAR = rf'([^{RAW_EXCLUDED}]|\\(["\\/bfnrt]|u({_NON_SURROGATE}|{_SURROGATE_PAIR})))'
