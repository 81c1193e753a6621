"""Moved to `lmnb.runtime.output.detokenizer`; kept so that old imports keep working."""

from lmnb.runtime.output.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
