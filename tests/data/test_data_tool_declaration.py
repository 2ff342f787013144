"""Tool schemas -> the TypeScript declaration Kimi K2.5/K2.6 templates read as `tools_ts_str`."""

from __future__ import annotations

import pytest

from kimi_nvfp4.data.tool_declaration import ToolSchemaError, encode_tools_typescript


def _one(parameters, name="f", description=None):
    function = {"name": name, "parameters": parameters}
    if description is not None:
        function["description"] = description
    body = encode_tools_typescript([{"type": "function", "function": function}])
    prefix, suffix = "# Tools\n\n## functions\nnamespace functions {\n", "\n}\n"
    assert body.startswith(prefix) and body.endswith(suffix)
    return body[len(prefix):-len(suffix)]


def test_required_first_then_optional_each_sorted_with_comments_and_constraints():
    params = {"type": "object", "required": ["b", "a"], "properties": {
        "z": {"type": "integer", "minimum": 0, "maximum": 10, "description": "Count."},
        "b": {"type": "string", "maxLength": 5, "pattern": "^x"},
        "a": {"type": "boolean", "default": True},
        "m": {"type": "string", "description": "Two\n\nlines", "default": "hi"},
    }}
    assert _one(params, description="Does f.") == (
        "// Does f.\n"
        "type f = (_: {\n"
        "  // Default: True\n"
        "  a: boolean,\n"
        "  // maxLength: 5, pattern: ^x\n"
        "  b: string,\n"
        "  // Two\n"
        "\n"
        "  // lines\n"
        "  // Default: \"hi\"\n"
        "  m?: string,\n"
        "  // Count.\n"
        "  // maximum: 10, minimum: 0\n"
        "  z?: number\n"
        "}) => any;")


def test_enums_unions_anyof_arrays_and_nested_objects():
    params = {"type": "object", "properties": {
        "mode": {"enum": ["r", "w", 1, None]},
        "maybe": {"type": ["string", "null"]},
        "either": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
        "tags": {"type": "array", "items": {"type": "string", "description": "A tag."}, "minItems": 1},
        "opts": {"type": "object", "properties": {"deep": {"type": "number"}}, "additionalProperties": False},
        "free": {"type": "object", "additionalProperties": {"type": "string"}},
        "anything": {},
    }}
    assert _one(params) == (
        "type f = (_: {\n"
        "  anything?: any,\n"
        "  either?: string | Array<number>,\n"
        "  free?: {\n"
        "    [k: string]: string\n"
        "  },\n"
        "  maybe?: string | null,\n"
        "  mode?: \"r\" | \"w\" | 1 | None,\n"
        "  opts?: {\n"
        "    deep?: number,\n"
        "    [k: string]: never\n"
        "  },\n"
        "  // minItems: 1\n"
        "  tags?: Array<\n"
        "    // A tag.\n"
        "    string\n"
        "  >\n"
        "}) => any;")


def test_defs_become_interfaces_and_self_reference_a_root_interface():
    params = {"type": "object", "$defs": {"Point": {"type": "object", "description": "A point.",
                                                   "required": ["x"], "properties": {"x": {"type": "number"}}}},
              "required": ["at"], "properties": {"at": {"$ref": "#/$defs/Point"}, "child": {"$ref": "#"}}}
    assert _one(params, name="tree") == (
        "interface parameters {\n"
        "  at: Point,\n"
        "  child?: parameters\n"
        "}\n"
        "// A point.\n"
        "interface Point {\n"
        "  x: number\n"
        "}\n"
        "type tree = (_: parameters) => any;")


def test_no_parameters_and_no_functions():
    assert _one({}) == "type f = (_: {}) => any;"
    assert encode_tools_typescript([]) == "" and encode_tools_typescript([{"type": "_plugin"}]) == ""


@pytest.mark.parametrize("schema", [
    {"$ref": "#/definitions/X"}, {"$ref": "#/$defs/Missing"}, {"type": ["string", "object", "null"], "enum": ["a"]},
    {"type": "string", "enum": [1]}, {"type": ["string", "date"]}, {"description": "no type"},
])
def test_schemas_outside_the_format_are_refused(schema):
    with pytest.raises(ToolSchemaError):
        _one({"type": "object", "properties": {"x": schema}})
