"""JSON schemas that broke the grammar compiler (issue #29), shared by the CLI and server tests."""

from __future__ import annotations


def chain(n: int) -> dict:
    """A $defs chain n links long (1,000 segfaulted llguidance's grammar check)."""
    return {"$ref": "#/$defs/d_0", "$defs": {
        f"d_{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d_{i + 1}"}}, "required": ["a"]}
        if i < n - 1 else {"type": "string"} for i in range(n)}}


def deep(n: int) -> dict:
    """Objects nested n levels (64 and more: llguidance's 'recursion limit exceeded')."""
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema
