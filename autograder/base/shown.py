"""Strings a student controls, made safe to show a person: in a terminal, summary.txt, grade_log.txt, an HTML
page or a spreadsheet.

A student chooses file names (and the student part of an LMS download name), the text their code prints and
the notebook text the grader quotes. Shown raw, an ANSI escape clears the instructor's screen or hides what
follows, a newline forges a line of the summary ("nothing flagged", "14 of 14 graded"), a bidi control
(U+202E and its kin) reverses what a reader sees, and a CSV cell starting with = + - @ runs as a formula when the
export is opened in a spreadsheet.

`line` is the one function that does it: every character Python does not count as printable (the C0 and C1
controls, ESC, newline, tab, carriage return, the bidi and other format controls, line and paragraph separators,
unassigned and private code points) becomes its visible backslash escape (`\\x1b`, `\\n`, `\\u202e`). The other
functions are `line` applied to one kind of output: `block` keeps the line breaks of the grader's own
multi-line text, `indented` sets off each line of a traceback, `name` quotes an odd name the way `repr` does, `html` escapes for HTML as well,
and `csv_cell` also neutralises formula prefixes. A string that is already clean comes back unchanged, so honest
names and messages read as they always did.
"""

from __future__ import annotations

import html as _html
import logging

FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet reads as the start of a formula (OWASP)


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}  # the escapes a reader knows, as repr writes them


def _escape(c: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def line(s: object) -> str:
    """`s` as text that stays on one line and shows every character it holds: each non-printable character
    (str.isprintable: controls, ESC, newlines, tabs, bidi and other format characters, separators) becomes its
    backslash escape. Backslashes already in `s` are kept: they cannot make anything act, only be read."""
    s = s if isinstance(s, str) else str(s)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _escape(c) for c in s)


def block(s: object) -> str:
    """`s` with its line breaks kept ("\\n") and everything else `line` escapes escaped: for a multi-line text
    whose lines are the grader's own (summary.txt read back to the terminal), not for a student's own text, whose
    line breaks could forge a line (use `line` on each of its pieces)."""
    s = s if isinstance(s, str) else str(s)
    return "\n".join(line(part) for part in s.split("\n"))


def name(s: str) -> str:
    """A student-chosen name for a report line: as it is when printable, else quoted and escaped as `repr`
    quotes it (its escapes are `line`'s: both follow str.isprintable)."""
    return s if s.isprintable() else repr(s)


def html(s: object, *, keep_lines: bool = False) -> str:
    """`line(s)` (or `block(s)` with `keep_lines`) escaped for HTML text and attribute values."""
    return _html.escape(block(s) if keep_lines else line(s))


def _number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def csv_cell(v: object) -> object:
    """A CSV cell a spreadsheet cannot run: strings are `line`-escaped, and one that starts (after spaces) with a
    formula prefix gets a leading `'`, unless it is a plain number ("-2", "+1.5", which a spreadsheet reads as a
    number anyway). Numbers, None and other non-strings pass unchanged."""
    if not isinstance(v, str):
        return v
    s = line(v)
    if (v.lstrip(" ").startswith(FORMULA_PREFIXES) or s.lstrip(" ").startswith(FORMULA_PREFIXES)) and not _number(v):
        return "'" + s
    return s


def csv_row(row):
    """`csv_cell` applied to every value of a row: a list (csv.writer) or a dict (csv.DictWriter)."""
    if isinstance(row, dict):
        return {k: csv_cell(v) for k, v in row.items()}
    return [csv_cell(v) for v in row]


class LogFormatter(logging.Formatter):
    """A logging.Formatter whose message is `line`-escaped and whose traceback is `indented`: a student's
    name or output in a log record can neither start a forged line nor send escapes to whoever reads the log."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return super().formatMessage(_escaped_record(record))

    def formatException(self, ei) -> str:  # noqa: N802
        return indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return indented(super().formatStack(stack_info))


def indented(s: str) -> str:
    """A multi-line text whose lines may hold a student's words (a traceback quoting their exception's message):
    each line `line`-escaped and set off by "  | ", so that no line of it can pass for a line of the log."""
    return "\n".join("  | " + line(part) for part in s.split("\n"))


def _escaped_record(record: logging.LogRecord) -> logging.LogRecord:
    r = logging.makeLogRecord(record.__dict__)
    r.message = line(record.message)
    return r
