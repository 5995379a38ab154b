"""Structured outputs: a grammar that every generated token must follow, enforced by llguidance.

The API, for gateway code (``response_format``, ``guided_*``, tool calls): put a
:class:`GrammarSpec` in ``SamplingParams(grammar=...)`` and the engine does the rest. Build it
with ``GrammarSpec.json_schema(schema)`` (a dict or JSON text, enforced whether or not the
client says ``strict``; compact separators ``", "`` and ``": "``), ``json_object()`` (any JSON
object), ``regex(pattern)`` (Rust regex syntax, whole output), ``lark(text)`` (llguidance's Lark
dialect) or ``ebnf(text)`` (llama.cpp's GBNF, or Lark). In Lark, a special token is written bare,
as the tokenizer names it: ``<｜tool▁calls▁begin｜>`` matches that one added token and never the
text that spells it (a quoted ``"<｜...｜>"`` would be text); ``%json {...}`` embeds a JSON
schema as a rule (:func:`lark_json` writes it with the compact separators; a bare ``%json``
lets the model pad with whitespace) and :func:`lark_literal` quotes text. So DeepSeek-V3's
tool call is::

    start: <｜tool▁calls▁begin｜> call <｜tool▁calls▁end｜>
    call: <｜tool▁call▁begin｜> "function" <｜tool▁sep｜> "get_weather\\n```json\\n" args
          "\\n```" <｜tool▁call▁end｜>
    args: %json {"type": "object", "properties": {...}, "x-guidance": {...}}

``spec.validate()`` checks what can be checked without a tokenizer and raises
:class:`InvalidRequestError` naming the spec's kind (``grammar.json_schema``); the engine checks
the rest (unknown special tokens) when it builds the request's matcher. In the engine every
sequence has its own :class:`GrammarMatcher`: the sampler masks the logits to the tokens the
grammar allows (EOS only where the grammar may end), the matcher advances with each accepted
token, and the request finishes ("stop") once the grammar can take no more.

:class:`GrammarVocab` holds what every matcher of one tokenizer shares (llguidance's token
trie); it is built once per engine (about a second for DeepSeek-V3's 129280 ids).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dsmesh.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance
    import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "ebnf")
# JSON as Python's json.dumps writes it: no free whitespace, so a model cannot pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 1 << 20  # a spec's source text, as sent


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of an allowed-token bitmask (bit ``t % 32`` of word ``t // 32``)."""
    return (vocab_size + 31) // 32


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (it matches these bytes, whatever the tokens)."""
    return json.dumps(text, ensure_ascii=False)


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body for JSON that follows ``schema``, laid out as ``json_schema`` specs are
    (compact separators; a bare ``%json`` would let a model pad with whitespace forever)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: ``kind`` is one of :data:`GRAMMAR_KINDS`, ``source`` its
    text (JSON text of the schema for ``json_schema``; empty for ``json_object``)."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls("lark", grammar)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @property
    def field(self) -> str:
        """The field errors name, relative to the sampling params (``grammar.regex``)."""
        return f"grammar.{self.kind}"

    def to_llguidance(self) -> str:
        """llguidance's grammar definition; raises InvalidRequestError on an unknown kind, a
        schema that is not a JSON object, or a GBNF grammar that does not convert."""
        import llguidance

        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError("grammar", f"kind must be one of {GRAMMAR_KINDS}")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(self.field, f"longer than {MAX_GRAMMAR_CHARS} characters")
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(self.field, f"is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(self.field, "must be a JSON object (a JSON Schema)")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "ebnf":
            try:
                return llguidance.grammar_from("ebnf", self.source)
            except ValueError as exc:
                raise InvalidRequestError(self.field, str(exc)) from exc
        return llguidance.LLMatcher.grammar_from_lark(self.source)

    def validate(self) -> None:
        """Raise InvalidRequestError naming ``grammar.<kind>`` when llguidance refuses the
        grammar; special tokens are checked only against a tokenizer (GrammarVocab.matcher)."""
        _check(self, self.to_llguidance(), None)


class GrammarMatcher:
    """The grammar state of one sequence: which tokens may come next, advanced token by token.

    Not thread-safe; the engine thread owns it (GrammarVocab.fill_bitmask reads many at once
    on llguidance's threads while the engine thread waits).
    """

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._failed = False

    @property
    def is_terminated(self) -> bool:
        """No token but EOS may follow (the grammar is complete), or a token was refused."""
        return self._failed or self._matcher.is_stopped()

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and terminated from then on) if the grammar does
        not allow it here."""
        if self._failed:
            return False
        if not self._matcher.consume_token(token_id):
            self._failed = True
        return not self._failed

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` [bitmask_words(vocab)] int32, C-contiguous."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @property
    def error(self) -> str:
        return self._matcher.get_error()


_LARK_TEXT = re.compile(r'"((?:[^"\\]|\\.)*)"|/((?:[^/\\\n]|\\.)+)/')


def spelled_texts(spec: GrammarSpec) -> Iterator[str]:
    """The texts ``spec`` spells out for the output: a regex's pattern, a Lark or GBNF
    grammar's quoted strings and /regex/ literals, a JSON schema's ``const``, ``enum`` and
    ``pattern`` strings (its descriptions and keys constrain nothing the model writes)."""
    if spec.kind == "regex":
        yield spec.source
    elif spec.kind in ("lark", "ebnf"):
        for quoted, regex in _LARK_TEXT.findall(spec.source):
            yield quoted or regex
    elif spec.kind == "json_schema":
        try:
            stack = [json.loads(spec.source)]
        except json.JSONDecodeError:
            return  # to_llguidance names the error
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                for key, value in node.items():
                    if key in ("const", "pattern") and isinstance(value, str):
                        yield value
                    elif key == "enum" and isinstance(value, list):
                        yield from (v for v in value if isinstance(v, str))
                    else:
                        stack.append(value)
            elif isinstance(node, list):
                stack.extend(node)


class GrammarVocab:
    """One tokenizer's vocabulary as llguidance indexes it, shared by every matcher.

    ``tokenizer_json`` is a ``tokenizer.json`` (Hugging Face tokenizers); ``vocab_size`` the
    model's logits width (ids past the tokenizer's are never allowed); ``eos_token_ids`` the
    tokens that end generation, allowed wherever the grammar may end.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._executor: llguidance.LLExecutor | None = None
        # Added tokens (DeepSeek-V3's <think>, <｜tool▁sep｜>, ...) are special to llguidance:
        # matched only where a grammar names the token, never as the text that spells it.
        added = json.loads(tokenizer_json).get("added_tokens", [])
        self._token_texts = {
            t["content"]: t["id"]
            for t in added
            if len(t["content"]) > 1
            and t["id"] < vocab_size
            and self._tokenizer.is_special_token(t["id"])
        }

    @classmethod
    def from_checkpoint(
        cls, folder: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarVocab:
        """From the checkpoint's ``tokenizer.json``; FileNotFoundError when it has none."""
        path = Path(folder) / "tokenizer.json"
        return cls(path.read_text(encoding="utf-8"), vocab_size, eos_token_ids)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for ``spec``; InvalidRequestError naming ``grammar.<kind>`` when the
        grammar is invalid for this tokenizer (a special token it does not have)."""
        import llguidance

        self._check_spelled_tokens(spec)
        matcher = llguidance.LLMatcher(self._tokenizer, spec.to_llguidance(), log_level=0)
        if matcher.is_error():  # llguidance reports a bad grammar here, never raises
            raise InvalidRequestError(spec.field, matcher.get_error().strip())
        return GrammarMatcher(matcher)

    def _check_spelled_tokens(self, spec: GrammarSpec) -> None:
        """Refuse a grammar that spells one of this tokenizer's added tokens as text: the
        tokenizer writes that text as the one token, which llguidance matches only where the
        grammar names the token, so the output would end at it (a known llguidance limit)."""
        for text in spelled_texts(spec):
            for content, token_id in self._token_texts.items():
                if content in text:
                    raise InvalidRequestError(
                        spec.field,
                        f"spells {content!r} as text, but this tokenizer writes it as one "
                        f"added token (id {token_id}), which a grammar matches only by naming "
                        f"it (in Lark, write {content} bare, outside quotes); a regex or JSON "
                        "schema cannot ask for it",
                    )

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher | None], out: np.ndarray) -> None:
        """Row i of ``out`` [>= len(matchers), bitmask_words(vocab)] int32 gets the tokens
        ``matchers[i]`` allows, or every token (-1 words) where it is None. Rows of several
        matchers are computed in parallel on llguidance's threads, without the GIL."""
        import llguidance

        rows = [(m._matcher, i) for i, m in enumerate(matchers) if m is not None]
        free = [i for i, m in enumerate(matchers) if m is None]
        if free:
            out[free] = -1
        if len(rows) == 1:
            matchers[rows[0][1]].fill_bitmask(out[rows[0][1]])  # type: ignore[union-attr]
        elif rows:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            assert out.flags["C_CONTIGUOUS"] and out.dtype == np.int32
            self._executor.unsafe_compute_mask_ptr(
                rows, out.ctypes.data, out.shape[1] * 4, out.shape[0]
            )


class GrammarMasks:
    """One engine's side of structured outputs: the checkpoint's vocabulary for matchers,
    indexed on first use, and the allowed-token bitmask rows of a step, in a buffer reused
    from step to step (pinned on CUDA: the sampler's copy to the device is asynchronous, and
    done before the next step fills the buffer, since each step waits for its tokens).

    ``checkpoint_dir`` names the folder whose ``tokenizer.json`` is indexed (called once,
    on the first grammar). Not thread-safe: the engine thread only."""

    def __init__(
        self,
        checkpoint_dir: Callable[[], Path],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        self._checkpoint_dir = checkpoint_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._device = device
        self._vocab: GrammarVocab | None = None
        import torch  # here, not at the top: the gateway imports the specs and never torch

        self._bitmask = torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)

    def vocab(self) -> GrammarVocab:
        """The tokenizer's vocabulary for grammar matchers, indexed on first use (about a
        second for DeepSeek-V3's); InvalidRequestError when the checkpoint has no
        ``tokenizer.json``."""
        if self._vocab is None:
            folder = self._checkpoint_dir()
            try:
                self._vocab = GrammarVocab.from_checkpoint(
                    folder, self._vocab_size, self._eos_token_ids
                )
            except FileNotFoundError as exc:
                raise InvalidRequestError(
                    "grammar", f"structured outputs need the checkpoint's tokenizer.json: {exc}"
                ) from exc
        return self._vocab

    def allowed(self, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor | None:
        """The allowed-token bitmask [len(matchers), ceil(vocab / 32)] int32 (host memory)
        of a step whose rows sample under ``matchers``, or None when none is constrained.
        Called after the forward is launched, so on a GPU the grammar's work overlaps it."""
        if all(m is None for m in matchers):
            return None
        return self.masks(matchers)

    def masks(self, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """The allowed-token bitmask [len(matchers), words] int32 of one step (every token
        for a None row), in the step's buffer: pinned on CUDA and reused, since a step's copy
        from it is done before the next step fills it (each step waits for its tokens)."""
        n = len(matchers)
        if self._bitmask.shape[0] < n:
            import torch

            pin = self._device.type == "cuda"
            shape = (n, self._bitmask.shape[1])
            self._bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
        rows = self._bitmask[:n]
        self.vocab().fill_bitmask(matchers, rows.numpy())
        return rows


def _check(spec: GrammarSpec, grammar: str, tokenizer: llguidance.LLTokenizer | None) -> None:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise InvalidRequestError(spec.field, messages[0].strip())
