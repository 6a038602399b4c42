"""Who handed in a file, and when the LMS says it arrived: each LMS's download names read by its own pattern.

An LMS writes the student's identity and (for some) a time stamp in a fixed place at the start of a download's
name; what follows is the student's own file name, which the student chose. So each pattern reads only its
LMS's own part, and never a date or a name from the student's part:

  Canvas      `<name>[_LATE]_<user id>_<submission id>_<file>`        name: lower-case letters and digits; no time
  Moodle      `<full name>_<participant id>_assignsubmission_file_<file>`                              no time
  Blackboard  `<assignment>_<username>_attempt_<YYYY-MM-DD-HH-MM-SS>[_<file>]`            time: the attempt stamp
  D2L         `<id>-<id> - <full name> - <Mon D, YYYY HMM AM/PM> - <file>`            time: the stamp after the name
  plain       `<student id>_<file>` (the kit's own naming, nbgrader zip_collect style)                 no time
  Gradescope  a class export's `submission_<n>/` folders, named in its `submission_metadata.yml`
              (`:submitters:` with `:sid:` / `:email:`, and `:created_at:`, the time)
  --lms-regex an instructor's own pattern: groups `student_id`, optionally `file` and `timestamp` (ISO 8601)

Where several patterns fit one name, the one whose own part ends first is the LMS's: the LMS writes its part
first, and a match further on reaches into the student's file name.

With a class list (`read_roster`: the CSV `make student ROSTER=` reads, with a `student_id` column, or a Canvas
gradebook export), the student part is matched to exactly one listed id: the longest listed id the name starts
with wins, underscores and all (`sim_student1_lab3_handin.zip` is `sim_student1`, not `sim`), and a name that
matches no id, or more than one, is a problem naming the file and the candidates. Without a class list, an id
with a separator in it cannot be told from a shorter id and a file name, so it is reported as ambiguous, with
the candidates, never cut.
"""

from __future__ import annotations

import csv
import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path

from labkit.env import LabkitError

SEP = "_"  # what the plain, Canvas, Moodle and Blackboard names put between their parts
_CANVAS = re.compile(r"^(?P<student>[A-Za-z0-9.\-]+?)(?P<late>_LATE)?_(?P<user_id>\d+)_(?P<submission_id>\d+)_"
                     r"(?P<file>.+)$", re.S)
_MOODLE = re.compile(r"^(?P<student>[^_].*?)_(?P<participant>\d+)_assignsubmission_(?:file|onlinetext)_(?P<file>.*)$",
                     re.S)
_BLACKBOARD = re.compile(r"^(?P<prefix>.+?)_attempt_(?P<stamp>\d{4}-\d{2}-\d{2}-\d{2}-\d{2}-\d{2})"
                         r"(?P<file>(?:_.*|\.[^.]*)?)$", re.S)
_D2L = re.compile(r"^(?P<ids>\d+-\d+) - (?P<student>.+?) - (?P<stamp>[A-Z][a-z]{2} \d{1,2}, \d{4} \d{3,4} [AP]M) - "
                  r"(?P<file>.+)$", re.S)
GRADESCOPE_META = "submission_metadata.yml"
_GRADESCOPE_DIR = re.compile(r"^submission_\d+$")


@dataclass(frozen=True)
class Roster:
    """A class list: the ids hand-ins are matched to, and other names the LMS may use for them."""

    ids: tuple[str, ...]  # student ids as grades.csv and the gradebook use them
    aliases: dict = field(default_factory=dict, hash=False)  # another name (Canvas user id, a folded name) -> ids
    source: str = ""  # the file it was read from


@dataclass
class Read:
    """What a download's name says."""

    lms: str  # "canvas", "moodle", "blackboard", "d2l", "plain", "regex", "gradescope"
    student_id: str | None  # the one id it names, or None (then `problem` says why)
    problem: str | None = None  # no id, or several: the file and the candidates
    candidates: list[str] = field(default_factory=list)
    file: str = ""  # the student's own part of the name
    stamp: dt.datetime | None = None  # the LMS's own time, naive (read in the late policy's zone), or None
    late_mark: bool = False  # the LMS marked it late (Canvas's _LATE)
    prefix: str = ""  # the LMS's part of the name (Canvas's re-upload prefix)
    canvas_id: str | None = None  # Canvas user id


def fold(s: str) -> str:
    """A name folded as LMSs shorten names: lower case, letters and digits only ("Doe, Jane" -> "doejane")."""
    return re.sub(r"[^a-z0-9]", "", s.lower())


def safe_id(raw: str) -> str:
    """A student id usable as a folder name and nbgrader id (letters, digits, '_', '.', '-')."""
    s = re.sub(r"[^A-Za-z0-9_.\-]+", "_", raw.strip()).strip("._-")
    return s[:64] or "unnamed"


_safe = safe_id


def read_roster(path: str | Path) -> Roster:
    """The class list at `path`: a CSV with a `student_id` column (the one `make student ROSTER=` reads), or a
    Canvas gradebook export (ids from SIS Login ID, else SIS User ID, else ID; Canvas user ids and the folded
    student names are aliases). LabkitError when it cannot be read, names nobody, or names an id twice."""
    p = Path(path)
    try:
        with p.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            cols = {c.strip() for c in reader.fieldnames or []}
    except (OSError, csv.Error, UnicodeDecodeError) as e:
        raise LabkitError(f"cannot read the roster {p}: {e}") from None
    rows = [{(k or "").strip(): v for k, v in r.items()} for r in rows]
    ids, aliases = [], {}

    def alias(key: str, sid: str) -> None:
        if key and sid not in aliases.setdefault(key, []):
            aliases[key].append(sid)

    if "student_id" in cols:
        ids = [r["student_id"].strip() for r in rows if (r.get("student_id") or "").strip()]
        for r, sid in zip([r for r in rows if (r.get("student_id") or "").strip()], ids, strict=True):
            for col in ("canvas_id", "ID", "name", "Student"):
                if (r.get(col) or "").strip():
                    alias(r[col].strip() if col in ("canvas_id", "ID") else fold(r[col]), sid)
    elif {"Student", "ID"} <= cols:
        for r in rows:
            name = (r.get("Student") or "").strip()
            if not name or "Points Possible" in name or name == "Student, Test":
                continue
            sid = next(((r.get(c) or "").strip() for c in ("SIS Login ID", "SIS User ID", "ID") if (r.get(c) or "").strip()),
                       "")
            if not sid:
                continue
            sid = _safe(sid)
            ids.append(sid)
            alias(r["ID"].strip(), sid)
            last, _, first = name.partition(",")
            for n in (name, f"{first} {last}"):
                alias(fold(n), sid)
    else:
        raise LabkitError(f"the roster {p} has no student_id column (nor is it a Canvas gradebook export with "
                          f"Student and ID); found columns {', '.join(sorted(cols)) or 'none'}")
    if not ids:
        raise LabkitError(f"the roster {p} names no student")
    bad = [i for i in ids if _safe(i) != i]
    if bad:
        raise LabkitError(f"the roster {p}: ids must be letters, digits, '_', '.' and '-' (not starting or ending "
                          f"with one of the last three): {', '.join(repr(b) for b in bad[:3])}")
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise LabkitError(f"the roster {p} lists {', '.join(twice[:3])} more than once")
    return Roster(tuple(ids), aliases, str(p))


def load_roster(roster: str | Path | Roster | None) -> Roster | None:
    """`roster` read when it is a path; a Roster or None as it is."""
    return roster if roster is None or isinstance(roster, Roster) else read_roster(roster)


def _one(lms: str, name: str, found: list[str], *, why: str, **kw) -> Read:
    found = list(dict.fromkeys(found))
    if len(found) == 1:
        return Read(lms, found[0], candidates=found, **kw)
    if found:
        return Read(lms, None, f"{_shown(name)}: its {why} fits {len(found)} ids of the class list "
                               f"({', '.join(found)}): rename it to hold one", found, **kw)
    return Read(lms, None, f"{_shown(name)}: its {why} matches no id of the class list", [], **kw)


def _shown(name: str) -> str:
    from autograder.base.shown import name as shown

    return repr(name) if shown(name) == name else shown(name)


def _by_name(lms: str, name: str, student: str, roster: Roster | None, *, alias: str | None = None, **kw) -> Read:
    """An LMS whose own part holds the student's name (or login): matched whole, never cut."""
    if roster is None:
        return Read(lms, _safe(student), candidates=[_safe(student)], **kw)
    if alias and roster.aliases.get(alias):
        return _one(lms, name, roster.aliases[alias], why=f"{lms} user id {alias!r}", **kw)
    exact = [i for i in roster.ids if i == student or i == _safe(student)]
    if exact:
        return _one(lms, name, exact, why=f"{lms} student part {student!r}", **kw)
    folded = [i for i in roster.ids if fold(i) == fold(student)] + roster.aliases.get(fold(student), [])
    return _one(lms, name, folded, why=f"{lms} student part {student!r}", **kw)


def _suffix_ids(prefix: str, roster: Roster) -> list[str]:
    """Listed ids a Blackboard prefix (`<assignment>_<username>`) ends with, longest first."""
    return sorted((i for i in roster.ids if prefix == i or prefix.endswith(SEP + i)), key=len, reverse=True)


def _blackboard(name: str, m: re.Match, assignment: str, roster: Roster | None) -> Read:
    prefix = m.group("prefix")
    stamp = dt.datetime.strptime(m.group("stamp"), "%Y-%m-%d-%H-%M-%S")
    kw = {"file": m.group("file").removeprefix(SEP), "stamp": stamp, "prefix": name[:m.end("stamp")]}
    if roster is not None:
        return _one("blackboard", name, _suffix_ids(prefix, roster)[:1], why=f"Blackboard username in {prefix!r}",
                    **kw)
    named = bool(assignment) and prefix.startswith(assignment + SEP)
    parts = (prefix[len(assignment) + 1:] if named else prefix).split(SEP)
    parts = parts if named or len(parts) == 1 else parts[1:]  # "<username>" alone, or after the assignment's name
    if len(parts) == 1 and parts[0]:
        return Read("blackboard", _safe(parts[0]), candidates=parts, **kw)
    cands = [SEP.join(parts[i:]) for i in range(len(parts) - 1, -1, -1)] or [prefix]
    return Read("blackboard", None, f"{_shown(name)}: Blackboard's username is one of "
                                    f"{', '.join(repr(c) for c in cands)} (the assignment's name or the id holds "
                                    "'_'): pass the class list with --roster", cands, **kw)


def _plain(name: str, assignment: str, roster: Roster | None) -> Read:
    cuts = [m.start() for m in re.finditer(SEP, name) if 0 < m.start() < len(name) - 1]
    if roster is not None:
        hits = sorted((i for i in roster.ids if name.startswith(i + SEP)), key=len, reverse=True)
        if not hits:
            stem = name.rsplit(".", 1)[0]
            hits = [i for i in roster.ids if stem == i]
        got = _one("plain", name, hits[:1], why="name")
        if got.student_id:
            got.file = name[len(got.student_id) + 1:] or name
            if len(hits) > 1:
                got.candidates = hits
        return got
    if not cuts:
        return Read("plain", None, None)
    cands = [name[:c] for c in cuts]
    anchored = [name[:c] for c in cuts if assignment and name[c + 1:].startswith(assignment)]
    pick = anchored[:1] if anchored else cands if len(cands) == 1 else []
    if len(pick) == 1 and SEP not in pick[0]:
        return Read("plain", _safe(pick[0]), candidates=pick, file=name[len(pick[0]) + 1:])
    shown_c = cands[:cands.index(pick[0]) + 1] if pick else cands
    return Read("plain", None, f"{_shown(name)}: the student id is one of {', '.join(repr(c) for c in shown_c)} "
                               "(an id may hold '_'): pass the class list with --roster", shown_c)


def _regex(name: str, rx: re.Pattern, roster: Roster | None) -> Read | None:
    m = rx.match(name)
    if not m:
        return None
    raw = m.group("student_id")
    gd = m.groupdict()
    stamp = None
    if gd.get("timestamp"):
        try:
            stamp = dt.datetime.fromisoformat(gd["timestamp"].replace("Z", "+00:00"))
        except ValueError:
            stamp = None
    got = _by_name("regex", name, raw, roster, file=gd.get("file") or name)
    got.stamp = stamp
    return got


def read_name(name: str, assignment: str = "", roster: Roster | None = None, lms_regex: str | None = None) -> Read | None:
    """What the LMS wrote into a download's file name `name` (no folder); None: no pattern fits.

    `lms_regex`, an instructor's own pattern, replaces the documented ones; `assignment` helps read plain and
    Blackboard names without a class list."""
    if lms_regex:
        return _regex(name, re.compile(lms_regex), roster)
    found = []
    m = _CANVAS.match(name)
    if m:
        found.append((m.start("file"), lambda m=m: _by_name(
            "canvas", name, m.group("student"), roster, alias=m.group("user_id"), file=m.group("file"),
            late_mark=bool(m.group("late")), prefix=name[:m.start("file")], canvas_id=m.group("user_id"))))
    m = _MOODLE.match(name)
    if m:
        found.append((m.start("file"), lambda m=m: _by_name(
            "moodle", name, m.group("student"), roster, alias=m.group("participant"), file=m.group("file"),
            prefix=name[:m.start("file")])))
    m = _BLACKBOARD.match(name)
    if m:
        found.append((m.end("stamp"), lambda m=m: _blackboard(name, m, assignment, roster)))
    m = _D2L.match(name)
    if m:
        found.append((m.start("file"), lambda m=m: _d2l(name, m, roster)))
    if found:
        return min(found, key=lambda f: f[0])[1]()
    got = _plain(name, assignment, roster)
    return None if got.student_id is None and got.problem is None else got


def _d2l(name: str, m: re.Match, roster: Roster | None) -> Read:
    date, hm, ampm = m.group("stamp").rsplit(" ", 2)
    try:
        stamp = dt.datetime.strptime(f"{date} {hm.zfill(4)} {ampm}", "%b %d, %Y %I%M %p")
    except ValueError:
        stamp = None
    return _by_name("d2l", name, m.group("student"), roster, file=m.group("file"), stamp=stamp,
                    prefix=name[:m.start("file")])


def read_folder(name: str, roster: Roster | None) -> Read:
    """The id of a per-student folder `name`: the name itself when it is an id (listed, with a class list)."""
    if roster is not None:
        if name in roster.ids:
            return Read("folder", name, candidates=[name])
        return _one("folder", name, [], why="folder name")
    sid = _safe(name)
    if sid == name:
        return Read("folder", sid, candidates=[sid])
    # Not an id as it stands ('alice-', a look-alike letter): a distinct id, never a classmate's
    import hashlib

    tagged = f"{sid[:55]}_x{hashlib.sha256(name.encode('utf-8', 'surrogateescape')).hexdigest()[:6]}"
    return Read("folder", tagged, candidates=[tagged])


def gradescope_metadata(folder: Path) -> dict[str, dict]:
    """`submission_<n>` -> {"ids": [sid or email of each submitter], "created_at": text} from a Gradescope export's
    submission_metadata.yml in `folder`; {} when there is none. LabkitError when it cannot be read."""
    p = folder / GRADESCOPE_META
    if not p.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise LabkitError(f"cannot read Gradescope's {p}: {e}") from None
    out = {}
    for key, sub in (data or {}).items() if isinstance(data, dict) else ():
        if not isinstance(sub, dict):
            continue
        people = sub.get(":submitters") or sub.get("submitters") or []
        ids = []
        for s in people if isinstance(people, list) else []:
            if isinstance(s, dict):
                sid = str(s.get(":sid") or s.get("sid") or "").strip()
                email = str(s.get(":email") or s.get("email") or "").strip()
                ids.append(sid or email.split("@", 1)[0])
        out[str(key)] = {"ids": [i for i in ids if i], "created_at": sub.get(":created_at") or sub.get("created_at")}
    return out


def read_gradescope(name: str, meta: dict[str, dict], roster: Roster | None) -> Read | None:
    """The id of a Gradescope export's folder `submission_<n>`, from its metadata; None: not such a folder."""
    if not _GRADESCOPE_DIR.match(name) or name not in meta:
        return None
    entry = meta[name]
    at = entry.get("created_at")
    if isinstance(at, str):
        try:
            at = dt.datetime.fromisoformat(at.strip().replace(" ", "T", 1).replace(" ", ""))
        except ValueError:
            at = None
    stamp = at if isinstance(at, dt.datetime) else None
    ids = entry["ids"]
    if len(ids) != 1:
        return Read("gradescope", None, f"{name}: Gradescope lists {len(ids)} submitters ({', '.join(ids) or 'none'})"
                                        ": grade a group's hand-in by hand", ids, stamp=stamp)
    got = _by_name("gradescope", name, ids[0], roster)
    got.stamp = stamp
    return got
