"""The proxy's OpenAPI schema. Its completion, chat, tokenize and detokenize routes take the raw
body (parsed strictly, checked with pdkv serve's models, forwarded unchanged), so FastAPI sees no
model in their signatures; `request_body` declares the same body models as `pdkv serve`
(pdkv.serve.protocol) and `install_openapi` adds their JSON schemas to the components, so a
client or a schema fuzzer reads one contract from either server."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pdkv.jsontypes import JSONObject
from pdkv.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
"""Route path -> the body model `pdkv serve` validates it with."""

_REF = "#/components/schemas/{model}"


def request_body(path: str) -> JSONObject:
    """`openapi_extra` of the route at `path`: a required JSON body of its model.

    Raises:
        KeyError: a path without a body model (BODY_MODELS).
    """
    ref = _REF.format(model=BODY_MODELS[path].__name__)
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": ref}}}}}


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (served at /openapi.json) include the body models' schemas."""

    def openapi() -> dict[str, object]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in BODY_MODELS.values():
                body = model.model_json_schema(ref_template=_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
