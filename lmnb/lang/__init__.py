"""The SGLang-style DSL: programs, expressions, interpreter and backends."""
