"""Tool schemas as the TypeScript namespace Kimi K2.5/K2.6 was trained on (`tools_ts_str`).

Kimi K2.5's remote tokenizer code (`tokenization_kimi.py` calling `tool_declaration_ts.py`) renders
OpenAI tool schemas as TypeScript type declarations and passes them to the chat template as
`tools_ts_str`; the template prefers that over `tools | tojson`. We never run that code, so this is
an independent implementation of the same text format:

    # Tools

    ## functions
    namespace functions {
    // Search the repository.
    type grep = (_: {
      // Python regular expression.
      pattern: string,
      path?: string
    }) => any;
    }

Rules: required properties first, then optional ones (`name?`), each group sorted by name;
`integer` is `number`; descriptions and the constraints (string maxLength/minLength/pattern,
number maximum/minimum, array minItems/maxItems) become `//` comment lines above a field, defaults
a `// Default: ...` line; enums are `"a" | "b"`, `anyOf` and type lists are unions; `$defs` become
`interface NAME {...}` declarations above the function and `$ref: "#"` a recursive `parameters`
interface. A schema outside this subset raises `ToolSchemaError`; the caller then falls back to
JSON, as Kimi's code does.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

INDENT = "  "
FIELD_SEPARATOR = ",\n"
SELF_REF_INTERFACE = "parameters"
_CONSTRAINT_KEYS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                    "integer": ("maximum", "minimum"), "array": ("minItems", "maxItems")}
_UNION_MEMBER = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
                 "null": "null", "object": "{}", "array": "Array<any>"}
_ENUM_VALUE_TYPES = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,)}


class ToolSchemaError(ValueError):
    """A tool's JSON schema uses something the TypeScript declaration format does not cover."""


def comment_lines(text: str, indent: str = "") -> str:
    """`// line` per line of `text`; blank lines stay blank (no indent)."""
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Defs:
    """`$defs` seen so far in one function's parameters, and whether `$ref: "#"` occurred."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.self_referenced = False

    def name_of(self, ref: str) -> str:
        if ref == "#":
            self.self_referenced = True
            return SELF_REF_INTERFACE
        prefix = "#/$defs/"
        if not ref.startswith(prefix):
            raise ToolSchemaError(f"unsupported $ref {ref!r} (expected '#' or '#/$defs/NAME')")
        name = ref.rsplit("/", 1)[-1]
        if name not in self.schemas:
            raise ToolSchemaError(f"$ref {ref!r} names no $defs entry")
        return name


def _kind(schema: Any) -> str:
    """Which rendering rule a schema follows (the order of these checks matters)."""
    if isinstance(schema, bool):
        return "any" if schema else "null"
    if not isinstance(schema, Mapping):
        raise ToolSchemaError(f"a schema must be an object or a boolean, got {schema!r}")
    if "$ref" in schema:
        return "ref"
    if "anyOf" in schema:
        return "anyOf"
    if "enum" in schema:
        return "enum"
    if "type" in schema:
        kind = schema["type"]
        return "union" if isinstance(kind, list) else str(kind)
    if not schema:
        return "any"
    raise ToolSchemaError(f"schema without type, enum, anyOf or $ref: {schema!r}")


def _docstring(schema: Any, indent: str) -> str:
    """Comment lines for a schema's description and constraints, each ending in a newline."""
    if not isinstance(schema, Mapping):
        return ""
    lines = []
    if schema.get("description"):
        lines.append(comment_lines(schema["description"], indent))
    kind = _kind(schema)
    keys = _CONSTRAINT_KEYS.get(kind, ()) if kind not in ("enum", "anyOf", "union", "ref") else ()
    constraints = sorted((k, schema[k]) for k in keys if k in schema)
    if constraints:
        lines.append(f"{indent}// " + ", ".join(f"{k}: {v}" for k, v in constraints))
    return "".join(line + "\n" for line in lines)


def _check_enum(schema: Mapping[str, Any]) -> None:
    declared = schema.get("type")
    if declared is None:
        return
    if isinstance(declared, list):
        # one type, or one type plus "null"
        if len(declared) == 1:
            declared = declared[0]
        elif len(declared) == 2 and "null" in declared:
            declared = declared[0] if declared[0] != "null" else declared[1]
        else:
            raise ToolSchemaError(f"enum type {declared} is not supported")
    allowed = _ENUM_VALUE_TYPES.get(declared)
    for value in schema["enum"]:
        if value is not None and allowed is not None and not isinstance(value, allowed):
            raise ToolSchemaError(f"enum value {value!r} is not a {declared}")


def _default_repr(value: Any) -> str:
    return repr(value) if isinstance(value, (int, float, bool)) else json.dumps(value, ensure_ascii=False)


def _field(name: str, schema: Any, optional: bool, indent: str, defs: _Defs) -> str:
    text = _docstring(schema, indent)
    default = schema.get("default") if isinstance(schema, Mapping) else None
    if default is not None:
        text += f"{indent}// Default: {_default_repr(default)}\n"
    return text + f"{indent}{name}{'?' if optional else ''}: {_type(schema, indent, defs)}"


def _object(schema: Mapping[str, Any], indent: str, defs: _Defs) -> str:
    if schema.get("$defs"):
        defs.schemas.update(schema["$defs"])
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    order = sorted(n for n in properties if n in required) + sorted(n for n in properties if n not in required)
    fields = [_field(n, properties[n], n not in required, indent + INDENT, defs) for n in order]
    extra = schema.get("additionalProperties")
    if extra is not None:
        if extra is True:
            extra_type = "any"
        elif extra is False:
            extra_type = "never"
        elif isinstance(extra, Mapping):
            extra_type = _type(extra, indent + INDENT, defs)
        else:
            raise ToolSchemaError(f"additionalProperties must be a boolean or a schema, got {extra!r}")
        fields.append(f"{indent + INDENT}[k: string]: {extra_type}")
    if not fields:
        return "{}"
    return "{\n" + FIELD_SEPARATOR.join(fields) + "\n" + indent + "}"


def _type(schema: Any, indent: str, defs: _Defs) -> str:
    kind = _kind(schema)
    if kind in ("any", "null"):
        return kind
    if kind == "ref":
        return defs.name_of(schema["$ref"])
    if kind == "anyOf":
        return " | ".join(_type(s, indent, defs) for s in schema["anyOf"])
    if kind == "enum":
        _check_enum(schema)
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
    if kind == "union":
        unknown = [t for t in schema["type"] if t not in _UNION_MEMBER]
        if unknown:
            raise ToolSchemaError(f"unsupported types in a type list: {unknown}")
        return " | ".join(_UNION_MEMBER[t] for t in schema["type"])
    if kind == "object":
        return _object(schema, indent, defs)
    if kind == "array":
        items = schema.get("items") or {}
        doc = _docstring(items, indent + INDENT)
        if doc:
            return f"Array<\n{doc}{indent + INDENT}{_type(items, indent + INDENT, defs)}\n{indent}>"
        return f"Array<{_type(items, indent, defs)}>"
    return "number" if kind == "integer" else kind


def _function(function: Mapping[str, Any]) -> str:
    defs = _Defs()
    parameters = function.get("parameters") or {}
    if not isinstance(parameters, Mapping):
        raise ToolSchemaError(f"parameters must be an object schema, got {parameters!r}")
    params_type = _object(parameters, "", defs)
    interfaces = []
    if defs.self_referenced:
        # a recursive root is declared as an interface, its fields in declaration order
        props = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        fields = FIELD_SEPARATOR.join(_field(n, s, n not in required, INDENT, defs) for n, s in props.items())
        interfaces.append(f"interface {SELF_REF_INTERFACE} {{" + (f"\n{fields}\n" if fields else "") + "}")
    for name, schema in list(defs.schemas.items()):
        description = schema.get("description", "") if isinstance(schema, Mapping) else ""
        lead = comment_lines(description) + "\n" if description else ""
        interfaces.append(f"{lead}interface {name} {_type(schema, '', defs)}")
    name = function.get("name", "function")
    signature = SELF_REF_INTERFACE if defs.self_referenced else params_type
    parts = ["\n".join(interfaces), comment_lines(function["description"]) if function.get("description") else "",
             f"type {name} = (_: {signature}) => any;"]
    return "\n".join(p for p in parts if p)


def encode_tools_typescript(tools: list[Mapping[str, Any]] | None) -> str:
    """The `# Tools` TypeScript namespace for OpenAI-format tools ('' when there are no functions)."""
    functions = [_function(t["function"]) for t in tools or ()
                 if isinstance(t, Mapping) and t.get("type") == "function" and t.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
