"""`python -m autograder similarity ASSIGNMENT --submissions DIR`: pairs of hand-ins far more alike than the class.

Each hand-in's module (the `%%writefile student_*.py` cell, autograder.checks.harness.student_file_from_notebook) is
turned into a stream of normalized Python tokens: comments, blank lines, indentation tokens, trailing commas and
statements that do nothing (`pass`, `...`, a lone literal or docstring) dropped, every name the student chose
replaced by one symbol (keywords, builtins and attribute names kept, but not attributes of self, whatever a
method calls its first parameter), every string and number by one symbol each. Renaming variables and
reformatting therefore change nothing. The stream is fingerprinted by winnowing (Schleimer, Wilkerson, Aiken,
SIGMOD 2003: hashes of all k-token windows, the minimum of every w consecutive hashes kept), which guarantees that
any shared run of at least k + w - 1 tokens is found. Fingerprints of the release's starter code, and those most
of the class shares (the assignment's natural boilerplate), are discarded before comparing.

A pair's similarity is the share of the smaller fingerprint set found in the other. A pair is flagged when it
is both high (>= `min_similarity`) and far above the class norm (more than `z` robust standard deviations,
1.4826 x MAD, above the median of all pairs). A flag is a reason to look, not a verdict: the report shows the
matching line ranges of both files side by side.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import io
import json
import keyword
import re
import statistics
import tempfile
import tokenize
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.env import LabkitError

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
         tokenize.ENDMARKER}
_KEEP_NAMES = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}
_CLOSE = {")", "]", "}"}
# bytes of one hand-in's module compared at most: a course module is a few KiB, and a MiB of code took ~6 s and
# ~500,000 tokens to fingerprint (the 2-core test machine), twice (the class, then the known answers)
MAX_MODULE_BYTES = 1 << 20


@dataclass
class SimilarityConfig:
    """How pairs are compared and flagged."""

    k: int = 10  # tokens per fingerprinted window (noise threshold: shorter shared runs are ignored)
    w: int = 5  # winnowing window: any shared run of k + w - 1 tokens is guaranteed to be found
    min_similarity: float = 0.6  # a flagged pair shares at least this share of the smaller file's fingerprints
    z: float = 3.0  # ... and lies this many robust standard deviations above the class median
    min_spread: float = 0.05  # floor of the spread, so a very uniform class does not flag tiny differences
    min_fingerprints: int = 8  # files with fewer own fingerprints (little beyond the starter) are not compared
    common_share: float = 0.5  # fingerprints in more than this share of the files (and > 3 files) are boilerplate
    known_share: float = 0.5  # a file with this share of its own fingerprints in a known answer's source is a copy


@dataclass
class Pair:
    """Two students' files compared."""

    a: str  # student id
    b: str  # student id
    similarity: float  # shared fingerprints / fingerprints of the smaller file
    shared: int  # fingerprints in common
    z: float = 0.0  # robust standard deviations above the class median
    flagged: bool = False
    lines_a: list[list[int]] = field(default_factory=list)  # matching line ranges [first, last] in a's file
    lines_b: list[list[int]] = field(default_factory=list)  # and in b's file


def tokens(source: str) -> list[tuple[str, int]]:
    """Normalized tokens of Python source, each with its line number; renaming and layout leave them unchanged."""
    out: list[tuple[str, int]] = []
    try:
        raw = [(t.type, t.string, t.start[0]) for t in tokenize.generate_tokens(io.StringIO(source).readline)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        # Broken code is still compared: a rougher split into words and symbols.
        raw = []
        for n, line in enumerate(source.splitlines(), 1):
            for m in re.finditer(r"[A-Za-z_]\w*|\d[\w.]*|\"[^\"]*\"|'[^']*'|\S", line.split("#", 1)[0]):
                s = m.group(0)
                typ = tokenize.NAME if s[0].isalpha() or s[0] == "_" else tokenize.NUMBER if s[0].isdigit() else \
                    tokenize.STRING if s[0] in "\"'" else tokenize.OP
                raw.append((typ, s, n))
    prev = prev2 = ""
    selfish, idle = _self_names(source), _idle_statements(raw)
    for i, (typ, s, line) in enumerate(raw):
        if typ in _SKIP or (typ == tokenize.ERRORTOKEN and not s.strip()) or i in idle:
            continue
        if typ == tokenize.NAME and s in selfish:
            s = "self"  # `def step(me, x): me.w` is `self.w` renamed
        if typ == tokenize.NAME:
            # A library's attribute (torch.isfinite, optimizer.step) is kept; the student's own (self.x) is not.
            tok = s if s in _KEEP_NAMES or (prev == "." and prev2 not in ("self", "cls")) else "V"
        elif typ == tokenize.STRING or getattr(tokenize, "FSTRING_START", -1) == typ:
            tok = "S"
        elif typ == tokenize.NUMBER:
            tok = "N"
        elif s == "," and _next_code(raw, i) in _CLOSE:
            continue  # a formatter's trailing comma
        else:
            tok = s
        out.append((tok, line))
        prev2, prev = prev, s
    return out


def _idle_statements(raw) -> set[int]:
    """Indices of statements that do nothing, one token each (`pass`, `...`, a lone literal or docstring): sprinkled
    between the lines of a copy they would break every shared window, so they are not compared."""
    idle, line = set(), []
    for i, (typ, _, _) in enumerate(raw):
        if typ == tokenize.NEWLINE:
            if len(line) == 1:
                t, v, _ = raw[line[0]]
                if t in (tokenize.NUMBER, tokenize.STRING) or v in ("pass", "...", "None", "True", "False", "Ellipsis"):
                    idle.add(line[0])
            line = []
        elif typ not in _SKIP:
            line.append(i)
    return idle


def _self_names(source: str) -> set[str]:
    """Names a method's first parameter goes by instead of self / cls (a rename that would otherwise turn every
    `self.x` into a kept attribute name); empty when the source does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # nested past the parser: 100,000 unary minuses
        return set()
    out = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for f in cls.body:
            static = isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(d, ast.Name) and d.id == "staticmethod" for d in f.decorator_list)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not static:
                args = f.args.posonlyargs + f.args.args
                if args:
                    out.add(args[0].arg)
    return out - _KEEP_NAMES


def _next_code(raw, i: int) -> str:
    for typ, s, _ in raw[i + 1:]:
        if typ not in _SKIP:
            return s
    return ""


def _hash(window: list[str]) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(window).encode(), digest_size=8).digest(), "big")


def kgram_hashes(toks: list[tuple[str, int]], k: int) -> list[tuple[int, int, int]]:
    """(hash, first line, last line) of every k-token window."""
    names = [t for t, _ in toks]
    return [(_hash(names[i:i + k]), toks[i][1], toks[i + k - 1][1]) for i in range(len(toks) - k + 1)]


def winnow(hashes: list[tuple[int, int, int]], w: int) -> dict[int, list[tuple[int, int]]]:
    """The winnowed fingerprints: hash -> line ranges where it was selected (rightmost minimum per window)."""
    picked: dict[int, list[tuple[int, int]]] = {}
    last = -1
    if hashes and len(hashes) < w:
        w = len(hashes)
    for start in range(len(hashes) - w + 1):
        win = hashes[start:start + w]
        j = min(range(w), key=lambda i: (win[i][0], -i))
        if start + j != last:
            last = start + j
            h, a, b = hashes[last]
            picked.setdefault(h, []).append((a, b))
    return picked


def _ranges(spans: list[tuple[int, int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def compare(files: dict[str, str], starter: str | None = None, cfg: SimilarityConfig | None = None,
            progress: bool = False) -> tuple[list[Pair], dict]:
    """Every pair of `files` (student id -> source), most similar first, and the class statistics."""
    from autograder.base.progress import bar

    cfg = cfg or SimilarityConfig()
    excluded = {h for h, _, _ in kgram_hashes(tokens(starter), cfg.k)} if starter else set()
    prints = {sid: {h: v for h, v in winnow(kgram_hashes(tokens(src), cfg.k), cfg.w).items() if h not in excluded}
              for sid, src in sorted(files.items())}
    counts: dict[int, int] = {}
    for fp in prints.values():
        for h in fp:
            counts[h] = counts.get(h, 0) + 1
    limit = max(3, cfg.common_share * len(prints))
    common = {h for h, n in counts.items() if n > limit}
    prints = {sid: {h: v for h, v in fp.items() if h not in common} for sid, fp in prints.items()}
    small = sorted(sid for sid, fp in prints.items() if len(fp) < cfg.min_fingerprints)
    ids = [sid for sid in prints if sid not in small]
    pairs = []
    pbar = bar(total=len(ids) * (len(ids) - 1) // 2, desc="comparing pairs", unit="pair", disable=not progress)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            shared = prints[a].keys() & prints[b].keys()
            sim = len(shared) / min(len(prints[a]), len(prints[b]))
            pairs.append(Pair(a, b, round(sim, 4), len(shared),
                              lines_a=_ranges([s for h in shared for s in prints[a][h]]),
                              lines_b=_ranges([s for h in shared for s in prints[b][h]])))
            pbar.update(1)
    pbar.close()
    sims = [p.similarity for p in pairs]
    med = statistics.median(sims) if sims else 0.0
    spread = max(1.4826 * statistics.median([abs(s - med) for s in sims]) if sims else 0.0, cfg.min_spread)
    for p in pairs:
        p.z = round((p.similarity - med) / spread, 2)
        p.flagged = p.similarity >= cfg.min_similarity and p.z >= cfg.z
    pairs.sort(key=lambda p: (-p.similarity, p.a, p.b))
    stats = {"files": len(files), "compared": len(ids), "pairs": len(pairs), "median": round(med, 4),
             "spread": round(spread, 4), "too_small": small, "starter_fingerprints_excluded": len(excluded),
             "common_fingerprints_excluded": len(common), "config": asdict(cfg)}
    return pairs, stats


# ------------------------------------------------------------------------------------------------ known answers


@dataclass
class Copy:
    """A hand-in far too close to code that ships to students as a finished answer."""

    student: str  # student id
    source: str  # what it matches: "labkit/loss_scaling.py", "torch/amp/grad_scaler.py"
    share: float  # the hand-in's own fingerprints (starter excluded) found in the source
    shared: int  # fingerprints in common
    lines: list[list[int]] = field(default_factory=list)  # matching line ranges [first, last] in the hand-in


def known_sources(assignment: str) -> dict[str, str]:
    """Code students can read that is the assignment's answer in finished form: the labkit modules its lab bans
    (autograder.labkit_answers.BANNED) and the torch files its sandbox hides (TORCH_HIDDEN), read from this
    machine's installs. {label: source}. A renamed copy of either scored full marks, since the reader bans names
    and imports, not code; the class comparison never sees a copy one student alone made."""
    import importlib.util

    from autograder import labkit_answers

    lab = assignment.split("_", 1)[0]
    out = {}
    for mod in labkit_answers.BANNED.get(lab, ()):
        spec = importlib.util.find_spec(f"labkit.{mod}")
        if spec and spec.origin:
            out[f"labkit/{mod}.py"] = Path(spec.origin).read_text(errors="replace")
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec and torch_spec.origin:
        site = Path(torch_spec.origin).parent.parent
        for rel in labkit_answers.TORCH_HIDDEN.get(lab, ()):
            if (site / rel).is_file():
                out[rel] = (site / rel).read_text(errors="replace")
    return out


def against_known(files: dict[str, str], known: dict[str, str], starter: str | None = None,
                  cfg: SimilarityConfig | None = None) -> list[Copy]:
    """Every hand-in whose own fingerprints lie mostly in one known answer's source (`known_sources`), the
    closest source for each, most copied first. Shares are of the hand-in, not of the (much longer) source,
    and the class's common fingerprints are not removed: a whole class copying the same module is still seen."""
    cfg = cfg or SimilarityConfig()
    excluded = {h for h, _, _ in kgram_hashes(tokens(starter), cfg.k)} if starter else set()
    sources = {label: {h for h, _, _ in kgram_hashes(tokens(src), cfg.k)} for label, src in known.items()}
    out = []
    for sid, src in sorted(files.items()):
        fp = {h: v for h, v in winnow(kgram_hashes(tokens(src), cfg.k), cfg.w).items() if h not in excluded}
        if len(fp) < cfg.min_fingerprints:
            continue
        best = None
        for label, hashes in sources.items():
            shared = fp.keys() & hashes
            share = len(shared) / len(fp)
            if share >= cfg.known_share and (best is None or share > best.share):
                best = Copy(sid, label, round(share, 4), len(shared),
                            _ranges([s for h in shared for s in fp[h]]))
        if best:
            out.append(best)
    return sorted(out, key=lambda c: (-c.share, c.student))


# ------------------------------------------------------------------------------------------------ the class


def starter_code(course: str | Path, assignment: str) -> str | None:
    """The release's starter module: the source notebook's %%writefile cell with its solution regions removed."""
    src = Path(course) / "source" / assignment / f"{assignment}.ipynb"
    if not src.is_file():
        return None
    for c in json.loads(src.read_text())["cells"]:
        text = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        if c["cell_type"] == "code" and text.startswith("%%writefile"):
            body = text.split("\n", 1)[1] if "\n" in text else ""
            return re.sub(r"^[ \t]*### BEGIN SOLUTION.*?### END SOLUTION[ \t]*\n?", "", body, flags=re.S | re.M)
    return None


def class_files(submissions: str | Path, assignment: str, scratch: Path, lms_regex: str | None = None,
                roster=None) -> tuple[dict[str, str], list[str]]:
    """student id -> the module their %%writefile cell writes (or a handed-in student_*.py); and notes.
    `roster`: the class list (path or lmsnames.Roster) the names are matched to, as grading matches them."""
    from autograder.checks import harness
    from autograder.intake import submissions as intake

    kw = {"lms_regex": lms_regex} if lms_regex else {}
    found = intake.collect(submissions, assignment, scratch=scratch / "intake", roster=roster, **kw)
    files, notes = {}, list(found.junk)
    for sub in found.submissions:
        text = None
        if sub.notebook and not sub.problem:
            d = scratch / "nb" / sub.student_id
            d.mkdir(parents=True, exist_ok=True)
            (d / "hand_in.ipynb").write_bytes(sub.files[sub.notebook])
            try:
                text = harness.student_file_from_notebook(d / "hand_in.ipynb", d).read_text(errors="replace")
            except Exception as e:  # a notebook without the cell is compared through its .py file, if any
                notes.append(f"{sub.student_id}: {str(e)[:150]}")
        if text is None:
            py = sorted(n for n in sub.files if Path(n).name.startswith("student_") and n.endswith(".py"))
            if py:
                text = sub.files[py[0]].decode("utf-8", errors="replace")
        if text is None:
            notes.append(f"{sub.student_id}: no student module found ({sub.problem or 'no %%writefile cell'})")
        elif len(text.encode("utf-8", "replace")) > MAX_MODULE_BYTES:
            notes.append(f"{sub.student_id}: its module is {len(text.encode('utf-8', 'replace')) / 2**20:.1f} MiB, "
                         f"over {MAX_MODULE_BYTES // 2**20} MiB: not compared (read it yourself)")
        else:
            files[sub.student_id] = text
    return files, notes


def report_text(assignment: str, pairs: list[Pair], stats: dict, notes: list[str], files: dict[str, str],
                top: int = 10, copies: list[Copy] | None = None) -> str:
    """The instructor's report: copies of known answers, flagged pairs with their matching lines, then the closest
    pairs, then notes. The hand-ins' lines and the notes are the students' text, each shown on one line with its
    escapes visible (autograder.base.shown): the report is read in a terminal, and the quoted lines must read as they are."""
    from autograder.base import shown
    from autograder.base.progress import table

    flagged = [p for p in pairs if p.flagged]
    lines = [f"similarity of {assignment}: {stats['compared']} files compared ({stats['pairs']} pairs); class median "
             f"{stats['median']:.2f}, spread {stats['spread']:.2f}; starter code and {stats['common_fingerprints_excluded']}"
             " fingerprints most of the class shares excluded", ""]
    if copies:
        lines.append(f"COPIES OF KNOWN ANSWERS: {len(copies)} hand-in(s) mostly made of code that ships to students")
        for c in copies:
            src = files[c.student].splitlines()
            lines.append(f"== {c.student}: {c.share:.0%} of its fingerprints are in {c.source} ({c.shared}); lines "
                         + ", ".join(f"{a}-{b}" for a, b in c.lines[:8]))
            a, b = c.lines[0] if c.lines else (1, 0)
            lines += [f"    {n:4d} | {shown.line(src[n - 1])[:120]}" for n in range(a, min(b, a + 5) + 1)
                      if n <= len(src)]
        lines.append("")
    elif copies is not None:
        lines += [f"no hand-in is mostly a copy of {', '.join(stats.get('known_sources', [])) or 'a known answer'}", ""]
    lines.append(f"FLAGGED: {len(flagged)} pair(s) far more alike than the class" if flagged else
                 "no pair stands out from the class")
    for p in flagged:
        lines += ["", f"== {p.a} and {p.b}: {p.similarity:.0%} of fingerprints shared ({p.shared}), "
                      f"{p.z:.1f} spreads above the median"]
        for sid, ranges in ((p.a, p.lines_a), (p.b, p.lines_b)):
            src = files[sid].splitlines()
            lines.append(f"  {sid}: lines " + ", ".join(f"{a}-{b}" for a, b in ranges[:8]))
            a, b = ranges[0] if ranges else (1, 0)
            lines += [f"    {n:4d} | {shown.line(src[n - 1])}" for n in range(a, min(b, a + 5) + 1) if n <= len(src)]
    lines += ["", "closest pairs:",
              table([[p.a, p.b, f"{p.similarity:.2f}", f"{p.z:.1f}", "FLAGGED" if p.flagged else ""]
                     for p in pairs[:top]], ["student", "student", "similarity", "z", ""]).rstrip()]
    if stats["too_small"]:
        lines.append(f"\nnot compared (too little code of their own beyond the starter): {', '.join(stats['too_small'])}")
    if notes:
        lines += ["", "notes:"] + [f"  {shown.line(n)}" for n in notes]
    return "\n".join(lines) + "\n"


def run(assignment: str, submissions: str | Path, *, course: str | Path = "assignments", out: str | Path,
        starter: str | Path | None = None, cfg: SimilarityConfig | None = None, lms_regex: str | None = None,
        progress: bool = True, roster: str | Path | None = None) -> tuple[list[Pair], Path]:
    """Compare a class's hand-ins; writes similarity.txt and similarity.json into `out`; returns (pairs, txt).
    `roster`: the class list CSV grading used (ids with `_` in them are read whole, as there)."""
    from autograder.base.progress import stage

    if not Path(submissions).exists():
        raise LabkitError(f"submissions folder {submissions} does not exist")
    if starter is not None and not Path(starter).is_file():
        raise LabkitError(f"starter file {starter} does not exist")
    if roster is not None:
        from autograder.intake import lmsnames

        roster = lmsnames.load_roster(roster)  # a clear error on a bad class list, before any work
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stage(f"reading the hand-ins of {assignment}", progress)
    with tempfile.TemporaryDirectory(prefix="labkit-sim-") as tmp:
        files, notes = class_files(submissions, assignment, Path(tmp), lms_regex, roster)
    start = Path(starter).read_text() if starter else starter_code(course, assignment)
    if start is None:
        notes.append("no starter code found (pass --starter or --course): shared starter lines count as similar")
    stage(f"fingerprinting {len(files)} files", progress)
    pairs, stats = compare(files, start, cfg, progress=progress)
    known = known_sources(assignment)
    copies = against_known(files, known, start, cfg)
    stats["known_sources"] = sorted(known)
    text = report_text(assignment, pairs, stats, notes, files, copies=copies if known else None)
    (out / "similarity.txt").write_text(text, encoding="utf-8")
    from labkit.bench import write_json

    write_json(out / "similarity.json", {"assignment": assignment, **stats, "notes": notes,
                                         "copies": [asdict(c) for c in copies],
                                         "pairs": [asdict(p) for p in pairs]})
    return pairs, out / "similarity.txt"
