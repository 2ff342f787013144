"""`otel:FILE`: OpenTelemetry GenAI spans exported as JSON: OTLP documents (`resourceSpans`) or one span per line,
attributes as OTLP key/value lists or a plain mapping. Spans without `gen_ai.input.messages` are not requests and
are passed over; the others are re-rendered with the checkpoint's chat template (data/chat_formats.py)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from ..chat_formats import otel_span
from ..loaders import add_request, iter_json_lines
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance, TrafficOptions

INPUT_MESSAGES = "gen_ai.input.messages"


def _any_value(value: Mapping[str, Any]) -> Any:
    """An OTLP AnyValue (`{"stringValue": ...}`, `{"arrayValue": {"values": [...]}}`, ...) as plain data."""
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    if "arrayValue" in value:
        return [_any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return _attributes(value["kvlistValue"].get("values", []))
    return None


def _attributes(attrs: Any) -> dict[str, Any]:
    if isinstance(attrs, Mapping):
        return dict(attrs)
    return {a["key"]: _any_value(a.get("value") or {}) for a in attrs or ()}


def _spans(record: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    if "resourceSpans" in record:
        for resource in record["resourceSpans"]:
            for scope in resource.get("scopeSpans", ()):
                yield from scope.get("spans", ())
    else:
        yield record


def _load(ctx: LoadContext) -> LoadResult:
    result = LoadResult(source=ctx.part)
    for where, record in iter_json_lines(ctx.body, result):
        if not isinstance(record, Mapping):
            result.note_skip(f"{where}: expected a JSON object", "invalid request")
            continue
        for k, span in enumerate(_spans(record)):
            attrs = _attributes(span.get("attributes"))
            if INPUT_MESSAGES not in attrs:
                continue
            start = span.get("startTimeUnixNano") or span.get("start_time")
            add_request(result, f"{where}#{k}", lambda w, a: otel_span(w, a, start), attrs)
    return result.require_some()


PLUGIN = DataSource("otel", "OpenTelemetry GenAI spans as JSON (gen_ai.input/output.messages; re-rendered)",
                    usage="otel:FILE", provenance=Provenance.RE_RENDERED, options_model=TrafficOptions,
                    load=_load)
