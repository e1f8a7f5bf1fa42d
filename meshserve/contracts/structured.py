"""What a request's output must match: a JSON schema, a regex, choices, a grammar, a structural tag.

``StructuredOutputParams`` is the plain-data form every entry point builds (the offline API as
``SamplingParams(structured_outputs=...)``, the HTTP edge from ``response_format``, vLLM's
``guided_*`` extras or its ``structured_outputs`` object, and tool calls). It checks its own shape
here, where it is made; whether the schema, regex or grammar itself is valid is checked by
``meshserve.structured`` (which needs the grammar library), with the same error type, so every
bad input names the field at fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The constraint kinds, in the order their fields appear.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputError(ValueError):
    """A structured-output constraint that cannot be used; ``param`` names the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)
class StructuredOutputParams:
    """One constraint on a request's output, named as in vLLM's ``StructuredOutputsParams``.

    Exactly one of the constraint fields is set:

    - ``json``: a JSON schema (a dict, or its JSON text); the output is JSON valid under it;
    - ``regex``: the output matches this regular expression in full;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: an EBNF grammar (GBNF style, rules written ``name ::= ...``, rooted at
      ``root``), or a Lark grammar when it has no ``::=``;
    - ``json_object=True``: any JSON object;
    - ``structural_tag``: an xgrammar structural tag (a dict, or its JSON text).

    ``disable_any_whitespace`` makes JSON output compact (no free whitespace between tokens), as
    in vLLM. A schema or structural tag given as a dict is stored as its JSON text (key order
    kept: it is the order the properties are generated in), so the params stay hashable and
    travel between processes unchanged.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | Mapping[str, Any] | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        field = "structured_outputs"
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                field, f"set exactly one of {', '.join(KINDS)}; got "
                       f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _json_text(self.json, f"{field}.json"))
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag",
                               _json_text(self.structural_tag, f"{field}.structural_tag"))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise StructuredOutputError(f"{field}.{name}", "must be a non-empty string")
        if self.choice is not None:
            choice = self.choice
            if (isinstance(choice, str) or not isinstance(choice, Sequence) or not choice
                    or not all(isinstance(c, str) for c in choice)):
                raise StructuredOutputError(f"{field}.choice",
                                            "must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(choice))
        if not isinstance(self.json_object, bool):
            raise StructuredOutputError(f"{field}.json_object", "must be true or false")
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputError(f"{field}.disable_any_whitespace", "must be true or false")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def field(self) -> str:
        """The field that holds the constraint, as errors name it."""
        return f"structured_outputs.{self.kind}"

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: equal keys share one compilation."""
        value = getattr(self, self.kind)
        text = "\x00".join(value) if self.kind == "choice" else str(value)
        return self.kind, text, self.disable_any_whitespace


def _json_text(value: object, field: str) -> str:
    """A JSON document (schema or tag) as text: given as text it must parse, given as data it
    must serialise."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(field, f"is not valid JSON: {exc}") from None
    else:
        parsed = value
    if not isinstance(parsed, Mapping):
        raise StructuredOutputError(field, "must be a JSON object")
    try:
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise StructuredOutputError(field, f"cannot be written as JSON: {exc}") from None
