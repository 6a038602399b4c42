"""What the grader shows people of a graded notebook, made safe to show: the feedback page and the notebook copy
kept for formgrader (rebuilt from plain parts), both made in a child process the grader can stop.

A graded notebook is the student's to shape, and nbconvert's markdown renderer takes time quadratic in some
inputs: on this project's 2-core test machine 64 KiB of "[" took 20 s to render and 256 KiB 318 s (the same for
unclosed tags and links). So pages are rendered by one child process per grader, with a budget of time per page
and of memory: past either the grader kills it, sends the summary box alone and starts another for the next
student. The child imports nbgrader and bleach, not torch, once.

The channel between them is narrow: the grader writes one JSON line per student (course root, assignment,
student, whether to render pages) to the child's stdin; the child answers one JSON line, {"log": text}, on its
own pipe; the page and the formgrader copies are files under that course root (a copy of the student's course
that no student process saw), which the grader reads back. Nothing the child says sets a score.

Run as `python -m autograder.gradebook.feedback --serve MEMORY_BYTES` only by `Renderer`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from autograder.base.notebook_limits import MAX_CELLS, MAX_OUTPUTS

RENDER_TIMEOUT_S = 60.0  # one student's pages and formgrader copies, seconds: an honest one takes about one
RENDER_MEMORY_BYTES = 3 * 2**30  # the rendering child's address space, bytes

# What a written answer may keep of HTML: text markup, lists, tables, links and images, no attribute that styles,
# scripts or names an element (an id or class could dress an answer up as the grader's summary box).
_ANSWER_TAGS = frozenset({"a", "abbr", "b", "blockquote", "br", "code", "del", "div", "em", "h1", "h2", "h3", "h4",
                          "h5", "h6", "hr", "i", "img", "kbd", "li", "ol", "p", "pre", "span", "strong", "sub", "sup",
                          "table", "tbody", "td", "th", "thead", "tr", "ul"})
_ANSWER_ATTRIBUTES = {"a": ["href", "title"], "img": ["src", "alt", "title"], "th": ["align"], "td": ["align"]}


def safe_markdown_html(text: str) -> str:
    """A student's markdown, rendered to HTML, with everything that could run script escaped into visible text
    (tags, event handlers, javascript: links); nbconvert's strip_files_prefix applied first, as it would be."""
    import bleach
    from nbconvert.filters import strip_files_prefix

    return bleach.clean(strip_files_prefix(text), tags=_ANSWER_TAGS, attributes=_ANSWER_ATTRIBUTES,
                        protocols={"http", "https", "mailto"}, strip=False)


def render_here(root: Path, assignment: str, student: str) -> str:
    """nbgrader generate_feedback for one student of the course at `root`, in this process; returns its log."""
    from nbgrader.converters import GenerateFeedback
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config.loader import PyFileConfigLoader

    buf = io.StringIO()
    try:
        for nb in (root / "autograded" / student / assignment).glob("*.ipynb"):
            nb.write_text(_page_safe(nb.read_text()))
        conf = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
        conf.HTMLExporter.template_name = "feedback"
        # The page renders the student's markdown and cell outputs, and instructors open it too: no markup that
        # runs script may survive. sanitize_html cleans outputs and ungraded markdown; nbgrader's own template
        # renders graded markdown (the written answers) through strip_files_prefix alone, so that filter cleans too.
        conf.HTMLExporter.sanitize_html = True
        conf.HTMLExporter.filters = {"strip_files_prefix": safe_markdown_html}
        cd = CourseDirectory(config=conf, root=str(root))
        cd.assignment_id, cd.student_id = assignment, student
        conv = GenerateFeedback(coursedir=cd, config=conf)
        conv.force = True
        handler = logging.StreamHandler(buf)
        conv.log.addHandler(handler)
        try:
            conv.start()
        finally:
            conv.log.removeHandler(handler)
    except Exception as e:  # a notebook nbconvert cannot render: the summary box alone goes out
        buf.write(f"generate_feedback failed: {type(e).__name__}: {e}\n")
    return buf.getvalue()


HANDED_IN = "as_handed_in"  # the plain copy of each notebook as handed in (its own outputs), for the marker


def show(root: Path, assignment: str, student: str, pages: bool = True) -> str:
    """What the child does for one student of the course copy at `root`: formgrader's copy of each graded notebook
    (plain_notebook, into root/formgrader/), the same of each notebook as handed in (root/submitted/, into
    root/formgrader/HANDED_IN/), then the feedback page if `pages`. Returns its log."""
    try:
        text = _write_plain(root / "autograded" / student / assignment, root / "formgrader")
    except Exception as e:  # the page may still render
        text = f"no formgrader copy: {type(e).__name__}: {str(e)[:200]}\n"
    handed = root / "submitted" / student / assignment  # as handed in: the outputs the written answers cite
    if handed.is_dir():
        try:
            text += _write_plain(handed, root / "formgrader" / HANDED_IN)
        except Exception as e:
            text += f"no plain copy of the notebook as handed in: {type(e).__name__}: {str(e)[:200]}\n"
    return text + (render_here(root, assignment, student) if pages else "")


def _serve(memory_bytes: int) -> None:
    """The child's loop: one request line in, one reply line out, until the grader closes stdin."""
    import ctypes
    import resource
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the grader
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, never into a reply
    from autograder.base.nbstart import skip_iri_checker

    skip_iri_checker()
    import nbgrader.converters  # noqa: F401  (once, before the first request: the grader waits on nothing else)

    for line in sys.stdin:
        req = json.loads(line)
        text = show(Path(req["root"]), req["assignment"], req["student"], bool(req["pages"]))
        replies.write(json.dumps({"log": text}) + "\n")
        replies.flush()


class Renderer:
    """The grader's side of the rendering child: started once, restarted after a page it had to stop."""

    def __init__(self, memory_bytes: int = RENDER_MEMORY_BYTES):
        self.memory_bytes = memory_bytes
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one page at a time: the grader's threads take turns

    def start(self) -> None:
        """Start the child now (its imports take seconds), so that it is ready by the first graded student."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[2])] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self._proc = subprocess.Popen([sys.executable, "-m", "autograder.gradebook.feedback", "--serve", str(self.memory_bytes)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      env=env, cwd="/")

    def stop(self) -> None:
        """Kill the child (the next page starts another)."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                f.close()
            self._proc = None

    def render(self, root: Path, assignment: str, student: str, *, pages: bool = True,
               timeout_s: float = RENDER_TIMEOUT_S) -> tuple[dict[str, str], str, str | None]:
        """Have the child write formgrader's copies of `student`'s graded notebooks in the course copy at `root`
        (under root/formgrader/) and, if `pages`, render their feedback; returns ({notebook id: html}, log, why
        the child was stopped or None). Past `timeout_s` seconds, or the child's memory, there is no page (and a
        formgrader copy only if it was written before)."""
        with self._lock:
            self._start()
            req = json.dumps({"root": str(root), "assignment": assignment, "student": student, "pages": pages}) + "\n"
            try:
                self._proc.stdin.write(req.encode())
                self._proc.stdin.flush()
                reply = self._reply(timeout_s)
            except OSError:
                reply = None
            stopped = None
            if reply is None:
                try:  # a child that closed its pipe is exiting: wait for it, to say which it was
                    self._proc.wait(timeout=1.0)
                    dead = True
                except subprocess.TimeoutExpired:
                    dead = False
                self._stop()
                work = "rendering the feedback" if pages else "rebuilding the notebooks kept for formgrader"
                stopped = ("the feedback renderer died (out of memory?)" if dead else
                           f"{work} took longer than {timeout_s:g} s and was stopped")
        if stopped:
            return {}, stopped + "\n", stopped
        found = {p.stem: p.read_text(errors="replace") for p in (root / "feedback" / student / assignment).glob("*.html")}
        return found, reply, None

    def _reply(self, timeout_s: float) -> str | None:
        """The child's next reply line, or None if it did not come within `timeout_s` seconds."""
        fd, buf = self._proc.stdout.fileno(), b""
        deadline = time.monotonic() + timeout_s
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            buf += chunk
        try:
            return str(json.loads(buf)["log"])
        except (ValueError, KeyError, TypeError):
            return None


RENDERER = Renderer()  # the grader's one child, started on first use

# ------------------------------------------------------------------------------------------- formgrader's copy

_IMAGES = ("image/png", "image/jpeg", "image/gif")
_BASE64 = re.compile(r"[A-Za-z0-9+/=\r\n ]*")
_CELL_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # nbformat's rule for cell ids
GRADE_ID = re.compile(r"[A-Za-z0-9_-]+")  # the ids nbgrader itself accepts (its cell-metadata check)
_NBGRADER_FLAGS = ("grade", "solution", "locked", "task")
# bytes of one rebuilt copy: within what the grader keeps of a file (grade.MAX_KEPT_BYTES, 16 MiB), which intake's
# 50 MiB notebooks outgrow (printed output; and a text escapes to up to 3x its UTF-8 bytes as ASCII JSON)
MAX_PLAIN_BYTES = 15 * 2**20


# The bidi controls (embeddings, overrides, isolates, marks): in a page or in formgrader they reorder what a reader
# sees, so a student's "1 of 4" can read as "4 of 1" and code can show other than it runs (Trojan Source).
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _text(v) -> str:
    """A notebook string field's text ('' for anything else), with lone surrogates replaced (they make the page
    that shows it fail to encode) and each bidi control shown as its escape (`\\u202e`), as shown.line does."""
    if isinstance(v, list):
        v = "".join(x for x in v if isinstance(x, str))
    v = v.encode("utf-8", "replace").decode() if isinstance(v, str) else ""
    return _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", v)


# MathJax typesets $...$ anywhere in a page's text; these macros make links, markup or new macros from it.
# The backslash may come as an HTML entity, which the page decodes before MathJax reads it.
_TEX_ACTIVE = re.compile(r"(?:\\|&#0*92;?|&#[xX]0*5[cC];?|&bsol;)(href|url|unicode|class|cssId|style|require|def|let|"
                         r"newcommand|renewcommand|csname|mmlToken)(?![A-Za-z])")


def inert_tex(text: str) -> str:
    """`text` with every TeX macro that MathJax would turn into a link or markup shown as its name instead."""
    return _TEX_ACTIVE.sub(r"\\backslash \1", text)


def _page_safe(notebook: str) -> str:
    """A graded notebook's JSON as the feedback page may render it: inert_tex where the page typesets math
    (markdown and raw cells, LaTeX, markdown and HTML outputs: sanitize_html keeps TeX, which is text to it), and
    no output metadata, cell attachments or cell metadata but nbgrader's (nbconvert writes an image's width and
    height into its tag unquoted, an attachment's data into a src attribute, and cell tags as CSS classes)."""
    nb = json.loads(notebook)
    if nb.get("nbformat") != 4:
        raise ValueError(f"nbformat {nb.get('nbformat')!r}, not 4")
    for c in nb.get("cells", []):
        c.pop("attachments", None)
        meta = c.get("metadata") if isinstance(c.get("metadata"), dict) else {}
        c["metadata"] = {"nbgrader": meta["nbgrader"]} if "nbgrader" in meta else {}  # tags become CSS classes
        if c.get("cell_type") in ("markdown", "raw"):
            c["source"] = inert_tex(_text(c.get("source")))
        elif "source" in c:
            c["source"] = _text(c.get("source"))
        for o in c.get("outputs", []) if c.get("cell_type") == "code" else []:
            if "metadata" in o:
                o["metadata"] = {}
            if o.get("output_type") == "stream":
                o["text"] = _text(o.get("text"))
            if o.get("output_type") == "error":  # a traceback quotes the student's message: bidi controls too
                o.update(ename=_text(o.get("ename")), evalue=_text(o.get("evalue")),
                         traceback=[_text(t) for t in o.get("traceback") or [] if isinstance(t, str)])
            if isinstance(o.get("data"), dict) and "text/plain" in o["data"]:
                o["data"]["text/plain"] = _text(o["data"]["text/plain"])
            for mime in ("text/latex", "text/markdown", "text/html"):
                if isinstance(o.get("data"), dict) and mime in o["data"]:
                    o["data"][mime] = inert_tex(_text(o["data"][mime]))
    return json.dumps(nb)


def _fenced(text: str) -> str:
    """`text` as a fenced code block, shown exactly as written: a fence longer than any run of backticks in it."""
    run = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, run + 1)
    return f"{fence}\n{text}\n{fence}"


def _nbgrader_meta(meta) -> dict:
    """The nbgrader fields formgrader needs, each of the type nbgrader writes; nothing else of the student's."""
    if not isinstance(meta, dict):
        return {}
    out = {k: meta[k] for k in _NBGRADER_FLAGS if isinstance(meta.get(k), bool)}
    if isinstance(meta.get("grade_id"), str) and GRADE_ID.fullmatch(meta["grade_id"]):
        out["grade_id"] = meta["grade_id"]
    if isinstance(meta.get("points"), (int, float)) and not isinstance(meta["points"], bool) \
            and math.isfinite(meta["points"]):
        out["points"] = meta["points"]
    if isinstance(meta.get("schema_version"), int) and not isinstance(meta["schema_version"], bool):
        out["schema_version"] = meta["schema_version"]
    if meta.get("cell_type") in ("code", "markdown"):
        out["cell_type"] = meta["cell_type"]
    if isinstance(meta.get("checksum"), str) and re.fullmatch(r"[0-9a-f]{1,128}", meta["checksum"]):
        out["checksum"] = meta["checksum"]
    return out


def _count(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _plain_output(o) -> dict | None:
    """One output rebuilt from text and raster images only, or None to drop it."""
    kind = o.get("output_type") if isinstance(o, dict) else None
    if kind == "stream":
        return {"output_type": "stream", "name": "stderr" if o.get("name") == "stderr" else "stdout",
                "text": _text(o.get("text"))}
    if kind == "error":
        tb = o.get("traceback") if isinstance(o.get("traceback"), list) else []
        return {"output_type": "error", "ename": _text(o.get("ename")), "evalue": _text(o.get("evalue")),
                "traceback": [_text(t) for t in tb if isinstance(t, str)]}
    if kind not in ("display_data", "execute_result"):
        return None
    data = o.get("data") if isinstance(o.get("data"), dict) else {}
    kept = {m: _text(data[m]) for m in _IMAGES if m in data and _BASE64.fullmatch(_text(data[m]))}
    dropped = sorted(m for m in data if m not in kept and m != "text/plain")
    plain = _text(data.get("text/plain"))
    if dropped:
        plain += ("\n" if plain else "") + f"[not shown by the grader: {', '.join(dropped)[:200]}]"
    out = {"output_type": kind, "data": {**kept, "text/plain": plain}, "metadata": {}}
    if kind == "execute_result":
        out["execution_count"] = _count(o.get("execution_count"))
    return out


def plain_notebook(data: bytes, max_bytes: int = MAX_PLAIN_BYTES) -> bytes:
    """A graded notebook rebuilt for formgrader, which renders it in the instructor's session without sanitizing:
    code cells with text and raster-image outputs, markdown and raw cells as code blocks showing exactly what was
    written, and nbgrader's cell fields. HTML, SVG, JavaScript and LaTeX outputs, attachments and any other
    metadata are left out. A copy over `max_bytes` has its longest texts cut (`_fitted`: head and tail kept, the cut
    said), so the grader keeps it. ValueError for data that is not an nbformat 4 notebook or has over MAX_CELLS
    cells or MAX_OUTPUTS outputs."""
    nb = json.loads(data)
    if not isinstance(nb, dict) or nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
        raise ValueError("not an nbformat 4 notebook")
    cells = [c for c in nb["cells"] if isinstance(c, dict)]
    outs = [c.get("outputs") if isinstance(c.get("outputs"), list) else [] for c in cells]
    if len(cells) > MAX_CELLS or sum(map(len, outs)) > MAX_OUTPUTS:
        raise ValueError(f"{len(cells)} cells, {sum(map(len, outs))} outputs (at most {MAX_CELLS}, {MAX_OUTPUTS})")
    plain = _plain_cells(cells, outs)
    return _fitted({"nbformat": 4, "nbformat_minor": 5, "cells": plain,
                    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                                 "language_info": {"name": "python"}}}, max_bytes)


def _plain_cells(cells: list[dict], outs: list[list]) -> list[dict]:
    plain, ids = [], set()
    for i, (c, o) in enumerate(zip(cells, outs, strict=True)):
        cid = c.get("id") if isinstance(c.get("id"), str) and _CELL_ID.fullmatch(c["id"]) else f"cell-{i}"
        cid = cid if cid not in ids else f"cell-{i}"
        ids.add(cid)
        meta = c.get("metadata") if isinstance(c.get("metadata"), dict) else {}
        nbg = _nbgrader_meta(meta.get("nbgrader"))
        cell = {"id": cid, "metadata": {"nbgrader": nbg} if nbg else {}}
        if c.get("cell_type") == "code":
            cell.update(cell_type="code", source=_text(c.get("source")), execution_count=_count(c.get("execution_count")),
                        outputs=[p for p in map(_plain_output, o) if p is not None])
        else:  # markdown, and raw cells, which nbconvert would print into the page as they are
            cell.update(cell_type="markdown", source=_fenced(_text(c.get("source"))))
        plain.append(cell)
    return plain


def _fitted(nb: dict, max_bytes: int) -> bytes:
    """The rebuilt notebook's bytes, within `max_bytes`: while it is larger, every output text and source longer
    than a limit (halved each time) keeps its head and tail around a line saying how much was cut, and a raster
    image larger than the limit is left out with a note; every cell stays, in order."""
    data = json.dumps(nb, indent=1).encode()
    keep = max(len(data), 1)
    while len(data) > max_bytes and keep > 64:
        keep //= 2
        for cell in nb["cells"]:
            cell["source"] = _cut(cell["source"], keep)
            for o in cell.get("outputs", []):
                if "text" in o:
                    o["text"] = _cut(o["text"], keep)
                if "traceback" in o:
                    o["traceback"] = [_cut(t, keep) for t in o["traceback"][-20:]]
                d = o.get("data", {})
                for m in [m for m in _IMAGES if len(d.get(m, "")) > keep]:
                    d["text/plain"] += f"\n[{m} of {len(d.pop(m)):,} characters not kept: this copy is capped]"
                if "text/plain" in d:
                    d["text/plain"] = _cut(d["text/plain"], keep)
        data = json.dumps(nb, indent=1).encode()
    return data


def _cut(text: str, keep: int) -> str:
    """`text` with all but its first and last `keep` // 2 characters replaced by a line saying how many were cut."""
    if len(text) <= keep + 100:  # the note itself takes about that much
        return text
    half = keep // 2
    return (f"{text[:half]}\n[... {len(text) - 2 * half:,} characters cut by the grader: this copy is capped at "
            f"{MAX_PLAIN_BYTES // 2**20} MiB ...]\n{text[len(text) - half:]}")


def _write_plain(graded: Path, dest: Path) -> str:
    """plain_notebook of each graded notebook into `dest` (whole files only); returns a log line per failure."""
    text = ""
    dest.mkdir(parents=True, exist_ok=True)
    for nb in sorted(graded.glob("*.ipynb")):
        try:
            data = plain_notebook(nb.read_bytes())
        except (ValueError, RecursionError) as e:
            text += f"no formgrader copy of {nb.stem}: {str(e)[:200]}\n"
            continue
        tmp = dest / f".{nb.name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, dest / nb.name)
    return text


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        sys.exit("autograder.gradebook.feedback is started by the grader (Renderer), not by hand")
    _serve(int(sys.argv[2]))
