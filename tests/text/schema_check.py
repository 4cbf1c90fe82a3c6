"""A small JSON-schema validator for the tests' schemas (type, properties, required, additionalProperties, enum,
const, anyOf, items, minItems / maxItems, minimum / maximum, minLength / maxLength), so tests need no extra package.
``errors(value, schema)`` lists what is wrong ([] when the value is valid)."""
from __future__ import annotations

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def errors(value, schema: dict, at: str = "$") -> list[str]:
    out = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_is_type(value, k) for k in kinds):
            return [f"{at}: {value!r} is not {kinds}"]
    if "const" in schema and value != schema["const"]:
        out.append(f"{at}: {value!r} != const {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{at}: {value!r} not in {schema['enum']}")
    if "anyOf" in schema and all(errors(value, s, at) for s in schema["anyOf"]):
        out.append(f"{at}: {value!r} matches none of anyOf")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{at}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                out += errors(v, props[k], f"{at}.{k}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{at}: unexpected {k!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{at}: {len(value)} items")
        for i, v in enumerate(value):
            out += errors(v, schema.get("items", {}), f"{at}[{i}]")
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        out.append(f"{at}: length {len(value)}")
    if _is_type(value, "number"):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            out.append(f"{at}: {value} out of range")
    return out
