"""Schema fuzzing of an HTTP server with schemathesis (issue 28): every operation of its OpenAPI
schema, with requests its schema allows (positive) and requests it forbids (negative).

What each response must be:
- never a 5xx;
- a 4xx carries OpenAI's error JSON: {"error": {"message": str, "type": str, ...}};
- a negative case (a value the schema forbids) is a 4xx, unless its body is one pydantic's lax
  mode coerces: pdkv keeps vLLM's lax coercion (a numeric string where a number is expected,
  `false` as token id 0). Such a case is told apart by the route's body model: it validates in
  lax mode and fails in strict mode (JSON input both times). Those are counted ("coerced"), not
  failures; a served negative case that strict validation accepts means the schema and the
  model disagree, a failure.
After the run the server's /health answers 200.
"""

from __future__ import annotations

import collections
import contextlib
import json
from dataclasses import dataclass, field

import httpx
import hypothesis
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import BaseModel, ValidationError
from schemathesis import GenerationMode

COERCED = 299
"""Pseudo status counted for a served negative case that only lax coercion admits."""


@dataclass
class FuzzReport:
    """Per (operation, mode): responses by status code, and the first bad response of each
    kind (what was sent and what came back)."""

    counts: dict[tuple[str, str], collections.Counter[int]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """One line per operation and mode: cases and status codes."""
        out = []
        for (label, mode), codes in sorted(self.counts.items()):
            total = sum(codes.values())
            detail = ", ".join(f"{'coerced' if c == COERCED else c}: {n}"
                               for c, n in sorted(codes.items()))
            out.append(f"{label} [{mode}] {total} cases ({detail})")
        return out


def openai_error(text: str) -> bool:
    """Whether `text` is OpenAI's error JSON."""
    try:
        body = json.loads(text)
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str)
            and isinstance(err.get("type"), str))


def lax_only(model: type[BaseModel], body: object) -> bool:
    """Whether `body` validates as `model` in lax mode but not in strict mode."""
    text = json.dumps(body)
    try:
        model.model_validate_json(text)
    except ValidationError:
        return False
    try:
        model.model_validate_json(text, strict=True)
    except ValidationError:
        return True
    return False


def fuzz(base_url: str, max_examples: int, models: dict[str, type[BaseModel]],
         timeout_s: float = 60.0) -> FuzzReport:
    """Fuzz every operation of `base_url`/openapi.json (positive and negative cases, up to
    `max_examples` each, derandomized) and return the report; the caller asserts
    `report.failures` is empty. `models`: each route's body model by label ("POST
    /v1/completions"), to tell lax coercion from a schema that says less than the model.

    Raises:
        httpx.HTTPError: the schema cannot be fetched; hypothesis errors other than an
            operation with nothing to make negative (e.g. GET /health).
    """
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                # Unsatisfiable: nothing in the operation can be made invalid (no parameters).
                with contextlib.suppress(hypothesis.errors.Unsatisfiable):
                    _run(op, mode, base_url, max_examples, timeout_s, report,
                         models.get(op.label))
        health = client.get("/health")
        if health.status_code != 200:
            report.failures["health after the run"] = f"{health.status_code} {health.text}"
    return report


def _run(op: schemathesis.APIOperation, mode: GenerationMode, base_url: str, max_examples: int,
         timeout_s: float, report: FuzzReport, model: type[BaseModel] | None) -> None:
    """Up to `max_examples` cases of one operation in one mode, recorded in `report`."""
    codes = report.counts.setdefault((op.label, mode.value), collections.Counter())

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(op.as_strategy(generation_mode=mode))
    def one(case: schemathesis.Case) -> None:
        r = case.call(base_url=base_url, timeout=timeout_s)
        negative = mode == GenerationMode.NEGATIVE
        if negative and r.status_code < 400 and model is not None and lax_only(model, case.body):
            codes[COERCED] += 1
            return
        codes[r.status_code] += 1
        why = None
        if r.status_code >= 500:
            why = "5xx"
        elif 400 <= r.status_code < 500 and not openai_error(r.text):
            why = "4xx without OpenAI's error JSON"
        elif negative and r.status_code < 400:
            why = "a negative case was served"
        if why is not None:
            sent = json.dumps({"query": case.query, "body": case.body}, default=str)
            report.failures.setdefault(f"{op.label} [{mode.value}] {why}",
                                       f"sent {sent[:4000]} -> {r.status_code} {r.text[:300]}")

    one()
