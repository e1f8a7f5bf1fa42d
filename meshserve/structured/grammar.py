"""A ``StructuredOutputParams`` as an xgrammar ``Grammar``: the parse that tells valid from invalid.

Building the grammar parses the schema, regex, EBNF or Lark text and needs no tokenizer; it takes
milliseconds even for large schemas. It is what an entry point runs to refuse bad input before a
request is queued. Compiling the grammar against the vocabulary (the slow part) is
``compiler.py``'s job, off the step loop.
"""

from __future__ import annotations

import json

import xgrammar as xgr

from meshserve.contracts.structured import StructuredOutputError, StructuredOutputParams

# Free whitespace between JSON tokens is capped at this many characters in a row: unbounded, a
# sampled model can pad an object with newlines until max_tokens and never close it.
MAX_JSON_WHITESPACE = 4


def build_grammar(params: StructuredOutputParams) -> xgr.Grammar:
    """The grammar ``params`` describes; an invalid one raises ``StructuredOutputError`` naming
    its field."""
    kind, field = params.kind, params.field
    try:
        if kind == "json":
            return _json_grammar(params.json, params.disable_any_whitespace)
        if kind == "json_object":
            return _json_grammar('{"type": "object"}', params.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        if kind == "grammar":
            text = params.grammar
            # vLLM's rule: GBNF/EBNF writes its rules with ``::=``; anything else is Lark.
            return xgr.Grammar.from_ebnf(text) if "::=" in text else xgr.Grammar.from_lark(text)
        return xgr.Grammar.from_structural_tag(params.structural_tag)
    except StructuredOutputError:
        raise
    except Exception as exc:  # xgrammar reports every parse failure as its own error types
        raise StructuredOutputError(field, f"invalid {_WHAT[kind]}: {_first_line(exc)}") from None


_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
         "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}


def _json_grammar(schema: str, compact: bool) -> xgr.Grammar:
    if compact:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    return xgr.Grammar.from_json_schema(schema, any_whitespace=True,
                                        max_whitespace_cnt=MAX_JSON_WHITESPACE)


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of ``choices``.

    A JSON string literal (non-ASCII kept as is) is also a valid xgrammar EBNF string literal:
    both escape quotes, backslashes and control characters the same way.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    # xgrammar prefixes C++ errors with a timestamped location: keep the message itself.
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line.split("] ", 1)[-1] if line.startswith("[") else line
    return type(exc).__name__
