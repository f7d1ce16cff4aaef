"""Text for people: every stored or received string that taskloop shows, logs or quotes in an
error goes through here. One rule each for cutting, quoting and escaping.

Feedback, outputs, reasons, versions and error messages are usually a model's reply or a user's
input: untrusted text. Shown raw, a newline forges a line of its own (an event, a table row, a
log record), an ANSI or OSC sequence recolours the terminal, clears it or plants a hyperlink, and
a bidi override makes text read backwards. So:

- ``visible(text)``: every character that is not printable (controls, tabs, line and paragraph
  separators, bidi and other format characters, lone surrogates) becomes a visible escape:
  ``\\n``, ``\\t``, ``\\x1b``, ``\\u202e``. The result is one line and prints nothing but itself.
  The CLI prints it as a ``rich.text.Text``, never as Rich markup (taskloop/cli/display.py).
- ``page_text(text)``: the same for a web page, which keeps line breaks and tabs (the page's
  template engine escapes HTML; this escapes what HTML would not show: controls, bidi overrides).
- ``terminal_text(text)``: the same for text a terminal shows as it comes (a phase's live text,
  ``taskloop watch``): line breaks and tabs stay, a carriage return (which would let the text
  overwrite its own line) is escaped. It is written as it is, never read as Rich markup.
- ``log_arg(value)``: a log record's argument, visible and cut to LOG_ARG_CHARS.
- ``terminal_json(raw)``: JSON text whose strings keep no character a terminal would act on
  (JSON itself escapes only U+0000..U+001F).
- ``cut(text, limit)``: at most ``limit`` characters, saying how many more there were.
- ``shown(value, limit)``: ``repr(value)`` for a message, cut; never raises.
- ``preview(value, limit)``: a JSON value on one line, cut (inputs and values in messages and tables).
"""

from __future__ import annotations

import json
import re
from typing import Any

MESSAGE_LIMIT = 8_000  # characters of a recorded error message
LOG_ARG_CHARS = 2_000  # characters of one argument of a log record
QUOTE_CHARS = 200  # characters of an untrusted value quoted in a log line or an error message

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _escaped(text: str, kept: str) -> str:
    """``text`` with every non-printable character but those in ``kept`` escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in kept else _escape(c) for c in text)


def visible(text: str) -> str:
    """``text`` on one line with every non-printable character (but the space) escaped."""
    return _escaped(text, " ")


def page_text(text: str) -> str:
    """``text`` for a web page: like ``visible``, but line breaks and tabs stay (a page shows a
    multi-line feedback or traceback as it is)."""
    return _escaped(text, " \n\r\t")


def terminal_text(text: str) -> str:
    """``text`` for a terminal that shows it as it comes: like ``visible``, but line breaks and tabs
    stay (a carriage return is escaped: it would let the text overwrite its own line)."""
    return _escaped(text, " \n\t")


def cut(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters cut)"


def log_arg(value: Any) -> Any:
    """A log argument that cannot start a line of its own (escaped) nor flood the log (cut); a
    value that is not a str is left to the formatter."""
    if not isinstance(value, str):
        return value
    return visible(cut(value, LOG_ARG_CHARS))


def shown(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters; never raises (the repr of an
    int past Python's digit limit does, and a user object's ``__repr__`` may)."""
    try:
        text = repr(value)
    except Exception:  # ValueError: an int of more digits than Python turns into text
        text = f"<an int of {value.bit_length()} bits>" if type(value) is int \
            else f"<a {type(value).__name__} whose repr() fails>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def preview(value: Any, limit: int = 60) -> str:
    """A JSON value on one line of at most ``limit`` characters (``...`` when it was cut)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = shown(value, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Characters JSON leaves raw inside strings that a terminal may act on: DEL, the C1 controls (0x9b
# is CSI on some terminals), line and paragraph separators, bidi and other format characters.
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb"
                          "\ud800-\udfff]")


def terminal_json(raw: str) -> str:
    """JSON text safe to print: the characters above, which can only occur inside its strings, as
    ``\\uXXXX`` escapes (still the same JSON)."""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", raw)
