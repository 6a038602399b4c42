"""What the grader shows people of a graded notebook, made safe to show: the feedback page, rendered in a child
process the grader can stop, and the notebook copy kept for formgrader, rebuilt from plain parts.

A graded notebook is the student's to shape, and nbconvert's markdown renderer takes time quadratic in some
inputs: on this project's 2-core test machine 64 KiB of "[" took 20 s to render and 256 KiB 318 s (the same for
unclosed tags and links). So pages are rendered by one child process per grader, with a budget of time per page
and of memory: past either the grader kills it, sends the summary box alone and starts another for the next
student. The child imports nbgrader and bleach, not torch, once.

The channel between them is narrow: the grader writes one JSON line per page (course root, assignment, student)
to the child's stdin; the child answers one JSON line, {"log": text}, on its own pipe; the page is a file under
that course root (a copy of the student's course that no student process saw), which the grader reads back.
Nothing the child says sets a score.

Run as `python -m autograder.feedback --serve MEMORY_BYTES` only by `Renderer`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

RENDER_TIMEOUT_S = 60.0  # one feedback page, seconds: an honest page takes about one
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
            nb.write_text(_math_inert(nb.read_text()))
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


def _serve(memory_bytes: int) -> None:
    """The child's loop: one request line in, one reply line out, until the grader closes stdin."""
    import ctypes
    import resource
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the grader
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, never into a reply
    import nbgrader.converters  # noqa: F401  (once, before the first request: the grader waits on nothing else)

    for line in sys.stdin:
        req = json.loads(line)
        text = render_here(Path(req["root"]), req["assignment"], req["student"])
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
            [str(Path(__file__).resolve().parents[1])] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self._proc = subprocess.Popen([sys.executable, "-m", "autograder.feedback", "--serve", str(self.memory_bytes)],
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

    def render(self, root: Path, assignment: str, student: str,
               timeout_s: float = RENDER_TIMEOUT_S) -> tuple[dict[str, str], str, str | None]:
        """Render the feedback of `student` in the course copy at `root`; returns ({notebook id: html}, log, why
        the child was stopped or None). A page that takes longer than `timeout_s` seconds, or more memory than the
        child has, yields no page."""
        with self._lock:
            self._start()
            req = json.dumps({"root": str(root), "assignment": assignment, "student": student}) + "\n"
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
                stopped = ("the feedback renderer died (out of memory?)" if dead else
                           f"rendering the feedback took longer than {timeout_s:g} s and was stopped")
        if stopped:
            return {}, stopped + "\n", stopped
        pages = {p.stem: p.read_text(errors="replace") for p in (root / "feedback" / student / assignment).glob("*.html")}
        return pages, reply, None

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
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")
_CELL_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # nbformat's rule for cell ids
GRADE_ID = re.compile(r"[A-Za-z0-9_-]+")  # the ids nbgrader itself accepts (its cell-metadata check)
_NBGRADER_FLAGS = ("grade", "solution", "locked", "task")


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else v if isinstance(v, str) else ""


# MathJax typesets $...$ anywhere in a page's text; these macros make links, markup or new macros from it.
_TEX_ACTIVE = re.compile(r"\\(href|url|unicode|class|cssId|style|require|def|let|newcommand|renewcommand|csname)"
                         r"(?![A-Za-z])")


def inert_tex(text: str) -> str:
    """`text` with every TeX macro that MathJax would turn into a link or markup shown as its name instead."""
    return _TEX_ACTIVE.sub(r"\\backslash \1", text)


def _math_inert(notebook: str) -> str:
    """A notebook's JSON with inert_tex applied where the page typesets math: markdown cells, LaTeX and markdown
    outputs (sanitize_html keeps TeX, which is text to it)."""
    nb = json.loads(notebook)
    for c in nb.get("cells", []):
        if c.get("cell_type") == "markdown":
            c["source"] = inert_tex(_text(c.get("source")))
        for o in c.get("outputs", []) if c.get("cell_type") == "code" else []:
            for mime in ("text/latex", "text/markdown"):
                if isinstance(o.get("data"), dict) and mime in o["data"]:
                    o["data"][mime] = inert_tex(_text(o["data"][mime]))
    return json.dumps(nb)


def _escaped(text: str) -> str:
    """Text for markdown that renders as it reads: tags and entities show as characters, and links and images
    stay text (nbconvert's markdown keeps javascript: links; `](` and `]:` escaped make none)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return inert_tex(text.replace("](", "]\\(").replace("]:", "]\\:"))


def _nbgrader_meta(meta) -> dict:
    """The nbgrader fields formgrader needs, each of the type nbgrader writes; nothing else of the student's."""
    if not isinstance(meta, dict):
        return {}
    out = {k: meta[k] for k in _NBGRADER_FLAGS if isinstance(meta.get(k), bool)}
    if isinstance(meta.get("grade_id"), str) and GRADE_ID.fullmatch(meta["grade_id"]):
        out["grade_id"] = meta["grade_id"]
    if isinstance(meta.get("points"), (int, float)) and not isinstance(meta["points"], bool):
        out["points"] = meta["points"]
    if isinstance(meta.get("schema_version"), int):
        out["schema_version"] = meta["schema_version"]
    if meta.get("cell_type") in ("code", "markdown"):
        out["cell_type"] = meta["cell_type"]
    if isinstance(meta.get("checksum"), str) and re.fullmatch(r"[0-9a-f]{1,128}", meta["checksum"]):
        out["checksum"] = meta["checksum"]
    return out


def _plain_output(o):
    """One output rebuilt from text and raster images only, or None to drop it."""
    from nbformat import v4

    if not isinstance(o, dict):
        return None
    kind = o.get("output_type")
    if kind == "stream":
        return v4.new_output("stream", name="stderr" if o.get("name") == "stderr" else "stdout", text=_text(o.get("text")))
    if kind == "error":
        tb = [t for t in o.get("traceback", []) if isinstance(t, str)] if isinstance(o.get("traceback"), list) else []
        return v4.new_output("error", ename=_escaped(_text(o.get("ename"))), evalue=_escaped(_text(o.get("evalue"))),
                             traceback=tb)
    if kind not in ("display_data", "execute_result"):
        return None
    data = o.get("data") if isinstance(o.get("data"), dict) else {}
    kept = {m: _text(data[m]) for m in _IMAGES if m in data and _BASE64.fullmatch(_text(data[m]))}
    dropped = sorted(m for m in data if m not in kept and m != "text/plain")
    plain = _text(data.get("text/plain"))
    if dropped:
        plain += ("\n" if plain else "") + f"[not shown by the grader: {', '.join(dropped)[:200]}]"
    kept["text/plain"] = plain
    if kind == "execute_result":
        count = o.get("execution_count")
        return v4.new_output(kind, data=kept, execution_count=count if isinstance(count, int) else None)
    return v4.new_output(kind, data=kept)


def plain_notebook(data: bytes) -> bytes:
    """A graded notebook rebuilt for formgrader, which renders it in the instructor's session without sanitizing:
    code, markdown with its raw HTML shown as text, outputs as text and raster images, nbgrader's cell fields.
    Scripts, SVG, HTML and JavaScript outputs, attachments and other metadata are left out. Raises ValueError for
    data that is not a notebook."""
    import nbformat
    from nbformat import v4

    nb = json.loads(data)
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError("not a notebook")
    cells = []
    for c in nb["cells"]:
        if not isinstance(c, dict):
            continue
        source = _text(c.get("source"))
        if c.get("cell_type") == "code":
            count = c.get("execution_count")
            outs = c.get("outputs") if isinstance(c.get("outputs"), list) else []
            cell = v4.new_code_cell(source, execution_count=count if isinstance(count, int) else None,
                                    outputs=[p for p in map(_plain_output, outs) if p is not None])
        else:  # markdown, and raw cells, which nbconvert would print into the page as they are
            cell = v4.new_markdown_cell(_escaped(source))
        meta = _nbgrader_meta((c.get("metadata") or {}).get("nbgrader") if isinstance(c.get("metadata"), dict) else None)
        if meta:
            cell.metadata["nbgrader"] = meta
        if isinstance(c.get("id"), str) and _CELL_ID.fullmatch(c["id"]):
            cell["id"] = c["id"]
        cells.append(cell)
    out = v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                "language": "python"},
                                                 "language_info": {"name": "python"}})
    ids = [c["id"] for c in cells]
    if len(set(ids)) != len(ids):  # duplicate ids from the student: fresh ones (formgrader keys cells by grade_id)
        for c in cells:
            c["id"] = v4.new_markdown_cell()["id"]
    return nbformat.writes(out).encode()


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        sys.exit("autograder.feedback is started by the grader (Renderer), not by hand")
    _serve(int(sys.argv[2]))
