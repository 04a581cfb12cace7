"""The tokenizer routes: /tokenize (a prompt or chat messages to ids) and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvserve.core.errors import ContextLengthError, InvalidRequestError
from kvserve.server.openai_fields import check_other_fields
from kvserve.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from kvserve.server.state import state_of
from kvserve.server.workers import offload

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    s = state_of(request).require_serving()
    s.check_model(body.model)
    check_other_fields(body)

    def encode() -> list[int]:
        if body.messages is not None and body.prompt is not None:
            raise InvalidRequestError("give `prompt` or `messages`, not both", "messages")
        if body.messages is not None:
            chat = ChatCompletionRequest.model_construct(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=None,
            )
            return s.encode(s.render_chat(chat), False, "messages")
        if body.prompt is not None:
            return s.encode(body.prompt, body.add_special_tokens, "prompt")
        raise InvalidRequestError("give `prompt` or `messages`", "prompt")

    tokens = await offload(encode)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": s.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    s = state_of(request).require_serving()
    s.check_model(body.model)
    check_other_fields(body)
    # As many ids as /tokenize can return (a text it takes has fewer characters than the context x
    # the longest token): 8 MB of ids would take seconds to decode into 85 MB of text.
    limit = s.engine.max_model_len
    ceiling = limit * (s.token_bound.longest_token if s.token_bound else 1)
    if len(body.tokens) > ceiling:
        raise ContextLengthError(
            f"{len(body.tokens)} token ids; this model's context is {limit} tokens, and "
            f"/tokenize returns at most {ceiling} (the context x its longest token)",
            "tokens",
        )
    vocab = s.engine.info.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", "tokens")
    s.require_tokenizer()
    return {"prompt": await offload(s.tokenizer.decode, body.tokens)}
