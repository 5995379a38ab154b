"""SGLang's native ``POST /generate``, as ``sglang.bench_serving --backend sglang`` and SGLang's
own clients send it.

Request: ``text`` (a string or a batch of strings) or ``input_ids`` (a list of ids or a batch
of lists), ``sampling_params`` (one object for every prompt, or one per prompt: SGLang's
names ``max_new_tokens``, ``min_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``n``, the penalties, ``json_schema``
/ ``regex`` / ``ebnf``, ``skip_special_tokens`` and ``no_stop_trim`` at their defaults),
``stream``, ``return_logprob`` with ``top_logprobs_num``, ``logprob_start_len`` and
``return_text_in_logprobs``, and ``rid``. Answer, per prompt and choice: ``{"text",
"output_ids", "meta_info": {"id", "finish_reason": {"type": "length", "length": N} | {"type":
"stop", "matched": ...} | {"type": "abort"}, "prompt_tokens", "completion_tokens",
"cached_tokens", "e2e_latency", and with ``return_logprob`` ``output_token_logprobs`` (one
``[logprob, id, text | null]`` a token), ``output_top_logprobs``, ``input_token_logprobs``,
``input_top_logprobs``}}``: one object, or a list for a batch or ``n`` > 1 (prompt p's
choice j at ``p * n + j``). Streamed, each ``data:`` event carries a choice's text and ids so
far (SGLang's default, not the increments) with ``index``, then ``data: [DONE]``.
Defaults are SGLang's: temperature 1, ``max_new_tokens`` 128. Bad input is 400 naming the
field (``sampling_params.top_p``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.gateway.choices import choice_inputs, generate_choices
from dsmesh.gateway.core import Delta, GatewayError, GenerationCore, GenerationInput
from dsmesh.gateway.openai_grammar import grammar_from_openai
from dsmesh.gateway.openai_logprobs import MIN_LOGPROB
from dsmesh.gateway.openai_params import OpenAIError, bad_param, openai_code, read_object
from dsmesh.gateway.rest import http_status, sse
from dsmesh.runtime.telemetry import context_from_headers

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
MAX_BATCH = 1024
_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "stream",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "rid",
        "model",
    }
)
_NUMBERS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
_AT_DEFAULT = {"skip_special_tokens": True, "spaces_between_special_tokens": True}
_AT_DEFAULT_OFF = ("no_stop_trim",)
_SAMPLING_FIELDS = (
    frozenset(_NUMBERS)
    | frozenset(_AT_DEFAULT)
    | frozenset(_AT_DEFAULT_OFF)
    | {
        "max_new_tokens",
        "min_new_tokens",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "n",
        "seed",
        "json_schema",
        "regex",
        "ebnf",
        "logit_bias",
    }
)


class SGLangRoutes:
    def __init__(self, core: GenerationCore) -> None:
        self.core = core

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/generate", self.generate)]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        start = time.monotonic()
        try:
            body = await read_object(request, _FIELDS, _error)
            inputs, per, batch = self._inputs(body)
            logprobs = _flag(body, "return_logprob")
            text_in_logprobs = _flag(body, "return_text_in_logprobs")
        except OpenAIError as exc:
            return exc.response()
        except GatewayError as exc:
            return _error(exc).response()
        outs = [
            _Output(
                self.core, inp, logprobs, text_in_logprobs, start, body.get("logprob_start_len")
            )
            for inp in inputs
        ]
        batch = batch or len(inputs) > 1  # a list: for a batch, or n > 1
        trace = context_from_headers(request.headers)
        deltas = generate_choices(self.core, inputs, trace, per_prompt=per)
        if body.get("stream"):
            events = _stream(deltas, outs)
            return await sse(
                request,
                events,
                done_marker=True,
                early_error=lambda e: _error(e).response(),
                late_error=lambda e: _error(e).body(),
            )
        try:
            async for delta in deltas:
                outs[delta.index].add(delta)
        except GatewayError as exc:
            return _error(exc).response()
        answers = [o.answer() for o in outs]
        return web.json_response(answers if batch else answers[0])

    def _inputs(self, body: dict[str, Any]) -> tuple[list[GenerationInput], int, bool]:
        """Every prompt's choices, prompt by prompt; the choices per prompt (0: one prompt);
        whether the prompts came as a batch."""
        prompts, batch = _prompts(body)
        raw = body.get("sampling_params")
        if isinstance(raw, list):
            if len(raw) != len(prompts):
                raise bad_param("sampling_params", f"{len(raw)} objects for {len(prompts)} prompts")
            per_prompt = raw
        else:
            per_prompt = [raw] * len(prompts)
        logprobs = _logprobs(body)
        start_len = body.get("logprob_start_len", -1)
        if isinstance(start_len, bool) or not isinstance(start_len, int):
            raise bad_param("logprob_start_len", "must be an integer")
        rid = body.get("rid")
        inputs: list[GenerationInput] = []
        ns = []
        for i, ((text, ids), sampling) in enumerate(zip(prompts, per_prompt, strict=True)):
            params, n = _sampling(sampling, logprobs, start_len >= 0 and logprobs is not None)
            ns.append(n)
            request_id = rid[i] if isinstance(rid, list) else (rid or "")
            if not isinstance(request_id, str):
                raise bad_param("rid", "must be a string or a list of strings")
            inp = self.core.prepare(request_id, text, ids, params)
            inputs += choice_inputs(inp, n)
        if len(set(ns)) > 1:
            raise bad_param("sampling_params.n", "must be the same for every prompt")
        return inputs, (ns[0] if len(prompts) > 1 else 0), batch


class _Output:
    """One choice's answer as its deltas arrive: the text and ids so far, the end, logprobs."""

    def __init__(
        self,
        core: GenerationCore,
        inp: GenerationInput,
        logprobs: bool,
        with_text: bool,
        start: float,
        logprob_start_len: int | None,
    ) -> None:
        self.core, self.rid, self.logprobs, self.with_text = (
            core,
            inp.request_id,
            logprobs,
            with_text,
        )
        self.start = start
        self.first_prompt_id = inp.prompt_ids[0]
        self.logprob_start_len = logprob_start_len or 0
        self.text = ""
        self.ids: list[int] = []
        self.entries: list[TokenLogprobs] = []
        self.prompt_entries: list[TokenLogprobs] | None = None
        self.last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.ids += delta.token_ids
        self.entries += delta.logprobs or ()
        if delta.prompt_logprobs is not None:
            self.prompt_entries = delta.prompt_logprobs
        self.last = delta

    def answer(self, index: int | None = None) -> dict[str, Any]:
        last = self.last
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self._finish(),
            "prompt_tokens": last.prompt_tokens if last else 0,
            "completion_tokens": last.completion_tokens if last else 0,
            "cached_tokens": last.cached_tokens if last else 0,
            "e2e_latency": time.monotonic() - self.start,
        }
        if self.logprobs:
            meta["output_token_logprobs"] = self._tokens(self.entries)
            meta["output_top_logprobs"] = self._tops(self.entries)
            if self.prompt_entries is not None:  # the first prompt token has none
                first = [None, self.first_prompt_id, self._text(self.first_prompt_id)]
                since = self.logprob_start_len
                meta["input_token_logprobs"] = [first, *self._tokens(self.prompt_entries)][since:]
                meta["input_top_logprobs"] = [None, *self._tops(self.prompt_entries)][since:]
        out: dict[str, Any] = {"text": self.text, "output_ids": self.ids, "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out

    def _finish(self) -> dict[str, Any] | None:
        reason = self.last.finish_reason if self.last else None
        if reason is None:
            return None
        if reason == "length":
            return {"type": "length", "length": self.last.completion_tokens}
        if reason == "stop":
            return {"type": "stop", "matched": self.ids[-1] if self.ids else None}
        return {"type": reason}

    def _tokens(self, entries: list[TokenLogprobs]) -> list[list[Any]]:
        return [self._item(e.logprob, e.token_id) for e in entries]

    def _tops(self, entries: list[TokenLogprobs]) -> list[list[list[Any]]]:
        return [[self._item(lp, t) for t, lp in e.top] for e in entries]

    def _item(self, logprob: float, token_id: int) -> list[Any]:
        return [max(logprob, MIN_LOGPROB), token_id, self._text(token_id)]

    def _text(self, token_id: int) -> str | None:
        return self.core.tokenizer.decode([token_id]) if self.with_text else None


async def _stream(deltas: AsyncIterator[Delta], outs: list[_Output]) -> AsyncIterator[dict]:
    async for delta in deltas:
        out = outs[delta.index]
        out.add(delta)
        if delta.token_ids or delta.finish_reason:
            yield out.answer(index=delta.index)


def _prompts(body: dict[str, Any]) -> tuple[list[tuple[str | None, list[int] | None]], bool]:
    """The prompts, and whether they came as a batch (a list of strings or of id lists)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_param("text", "give exactly one of text and input_ids")
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise bad_param("text", "must be a non-empty string or list of them")
        prompts: list[tuple[str | None, list[int] | None]] = [(t, None) for t in texts]
        batch = isinstance(text, list)
    else:
        batch = isinstance(ids, list) and bool(ids) and all(isinstance(p, list) for p in ids)
        lists = ids if batch else [ids]
        for i, p in enumerate(lists):
            ok = isinstance(p, list) and p and all(type(t) is int for t in p)
            if not ok:
                name = f"input_ids[{i}]" if batch else "input_ids"
                raise bad_param(name, "must be a non-empty list of token ids")
        prompts = [(None, list(p)) for p in lists]
    if len(prompts) > MAX_BATCH:
        raise bad_param("text" if text is not None else "input_ids", f"at most {MAX_BATCH}")
    return prompts, batch


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad_param(name, "must be a boolean")
    return value


def _logprobs(body: dict[str, Any]) -> int | None:
    """``return_logprob`` with ``top_logprobs_num`` (default 0) -> SamplingParams.logprobs."""
    top = body.get("top_logprobs_num", 0)
    if isinstance(top, bool) or not isinstance(top, int):
        raise bad_param("top_logprobs_num", "must be an integer")
    return top if _flag(body, "return_logprob") else None


def _sampling(raw: Any, logprobs: int | None, prompt_logprobs: bool) -> tuple[SamplingParams, int]:
    sp = {} if raw is None else raw
    if not isinstance(sp, dict):
        raise bad_param("sampling_params", "must be an object or a list of objects")
    for name in sp:
        if name not in _SAMPLING_FIELDS:
            raise bad_param(f"sampling_params.{name}", "unknown or unsupported field")
    for name, default in _AT_DEFAULT.items():
        if sp.get(name, default) is not default:
            raise bad_param(f"sampling_params.{name}", f"only {str(default).lower()} is supported")
    for name in _AT_DEFAULT_OFF:
        if sp.get(name):
            raise bad_param(f"sampling_params.{name}", "only false is supported")

    def get(name: str, types: tuple[type, ...], default: Any) -> Any:
        value = sp.get(name)
        if value is None:
            return default
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise bad_param(f"sampling_params.{name}", "has the wrong type")
        return value

    stop = get("stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise bad_param("sampling_params.stop", "must be a string or a list of strings")
    stop_ids = get("stop_token_ids", (list,), [])
    if not all(type(t) is int for t in stop_ids):
        raise bad_param("sampling_params.stop_token_ids", "must be a list of token ids")
    bias = get("logit_bias", (dict,), {})
    try:
        pairs = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
        grammar = grammar_from_openai({k: sp.get(k) for k in ("json_schema", "regex", "ebnf")})
    except InvalidRequestError as exc:
        raise bad_param(f"sampling_params.{exc.field}", exc.reason) from exc
    except (TypeError, ValueError) as exc:
        raise bad_param("sampling_params.logit_bias", "maps token ids to numbers") from exc
    params = SamplingParams(
        max_new_tokens=get("max_new_tokens", (int,), DEFAULT_MAX_NEW_TOKENS),
        min_tokens=get("min_new_tokens", (int,), 0),
        top_k=max(get("top_k", (int,), 0), 0),  # SGLang's -1 is "off", as 0 is here
        seed=get("seed", (int,), None),
        stop=stop,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=get("ignore_eos", (bool,), False),
        logit_bias=pairs,
        logprobs=logprobs,
        prompt_logprobs=logprobs if prompt_logprobs else None,
        grammar=grammar,
        **{name: float(get(name, (int, float), d)) for name, d in _NUMBERS.items()},
    )
    try:
        params.validate()
    except InvalidRequestError as exc:
        field = {"max_new_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}.get(
            exc.field, exc.field
        )
        raise bad_param(f"sampling_params.{field}", exc.reason) from exc
    n = get("n", (int,), 1)
    if not 1 <= n <= 128:
        raise bad_param("sampling_params.n", f"must be in [1, 128], got {n}")
    return params, n


def _error(exc: GatewayError) -> OpenAIError:
    status = http_status(exc.code)
    kind = "invalid_request_error" if status < 500 else "server_error"
    param = exc.message.partition(": ")[0] if status == 400 else None
    return OpenAIError(status, exc.message, param=param, code=openai_code(exc.code), kind=kind)
