"""Late work: when each hand-in was submitted, and what a late policy takes off the total.

Submission times come from, in order of trust:
  1. an explicit CSV (`student_id,submitted_at`, ISO 8601), e.g. exported from the LMS;
  2. the stamp the LMS itself writes, in its documented place (autograder.intake.lmsnames): Blackboard's
     `_attempt_2025-03-04-23-15-02` after the username, D2L's `Mar 4, 2025 1115 PM` after the student's name,
     Gradescope's `:created_at:` in its export's metadata, or the `timestamp` group of the instructor's own
     --lms-regex. Canvas and Moodle names carry no time (Canvas marks late ones `_LATE`); nor do the kit's plain
     `<id>_<file>` names;
  3. archive metadata: the newest entry date of their folder or file in the LMS's class zip, or of the
     student's own zip, which their machine dated: it can show a hand-in late, never on time.
Times without a zone are read in the policy's time zone. After the LMS's own part, a name is the student's own
file name: no date in it is read, whatever its format, so it can neither clear nor hide a hand-in's lateness. A
hand-in with no time is "not checked" with the reason. Folders of loose files carry no trustworthy time
(copying resets it): give those students' times in the CSV.

Policy: submitted after the (extended) due date plus the grace period, a hand-in loses `per_day_pct` percent
of the assignment's points for every started day after the due date, at most `cap_pct` percent; the total
never goes below 0. Extensions (`student_id,days` or `student_id,due`) move one student's due date.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import math
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from autograder.intake import lmsnames
from autograder.intake import submissions as intake
from labkit.env import LabkitError

MAX_NESTED_ZIP_BYTES = 200 * 2**20  # a student's zip inside a class zip is read into memory to date it

CANVAS_NAME = re.compile(r"^(?P<name>[A-Za-z0-9.\-]+)_(?:LATE_)?(?P<user_id>\d+)_(?P<submission_id>\d+)_")
NO_STAMP = {"canvas": "Canvas names carry no time", "moodle": "Moodle names carry no time",
            "plain": "a plain <id>_<file> name carries no LMS time", "regex": "--lms-regex has no timestamp group here",
            "gradescope": "Gradescope's metadata gives no :created_at:"}


@dataclass
class Stamp:
    """When one hand-in was submitted, and how the grader knows."""

    at: dt.datetime | None  # aware datetime, None when unknown
    source: str  # "csv", "file name", "zip entry date" (the LMS's class zip), STUDENT_ZIP, or "" when unknown
    lms_late: bool = False  # the LMS marked it late in the file name (Canvas's _LATE_), even without a time
    why: str = ""  # why no time is known (no LMS stamp in the name, ...), when `at` is None


STUDENT_ZIP = "student's zip entry date"  # dated by the student's machine: it may show lateness, never clear it


@dataclass
class LatePolicy:
    """A due date and what lateness costs."""

    due: dt.datetime  # the due date (aware; naive values are read in `timezone`)
    grace_s: float = 0.0  # seconds after the due date that still count as on time
    per_day_pct: float = 10.0  # percent of the assignment's points lost per started day late
    cap_pct: float = 100.0  # at most this percent of the points is taken off
    extensions: dict[str, dt.datetime] = field(default_factory=dict)  # student id -> that student's due date
    times_csv: str | None = None  # explicit submission times (student_id,submitted_at); beats names and zips
    timezone: str = "UTC"  # zone for times written without one (names, zip entries, the CSV, --due)
    roster: str | None = None  # the class list ids are read against (grade --roster), as intake reads them

    def describe(self) -> str:
        grace = f", grace {self.grace_s / 60:g} min" if self.grace_s else ""
        return (f"due {self.due.isoformat()}{grace}, -{self.per_day_pct:g}% of the points per started day late, "
                f"at most -{self.cap_pct:g}%" + (f"; {len(self.extensions)} extension(s)" if self.extensions else ""))

    def due_for(self, student_id: str) -> dt.datetime:
        return self.extensions.get(student_id, self.due)


def _zone(name: str) -> dt.tzinfo:
    if name.upper() == "UTC":
        return dt.UTC
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise LabkitError(f"unknown time zone {name!r} (use an IANA name such as Europe/Berlin, or UTC)") from e


def parse_time(text: str, tz: str = "UTC", what: str = "time") -> dt.datetime:
    """An aware datetime from ISO 8601 text ("2025-03-04T23:59", "2025-03-04 23:59:00+01:00", "...Z")."""
    try:
        t = dt.datetime.fromisoformat(str(text).strip().replace("Z", "+00:00"))
    except ValueError as e:
        raise LabkitError(f"{what} {text!r} is not an ISO 8601 date/time such as 2025-03-04T23:59") from e
    return t if t.tzinfo else t.replace(tzinfo=_zone(tz))


def time_from_name(name: str, tz: str = "UTC", lms_regex: str | None = None) -> dt.datetime | None:
    """The submission time the LMS itself wrote into a download's file name, in its documented place, or None.

    Only the LMS's own part of the name is read (autograder.intake.lmsnames): Blackboard's attempt stamp and D2L's
    stamp after the student's name. A date in the student's own file name, in any format and however many, is
    never read; Canvas, Moodle and plain names carry none."""
    got = lmsnames.read_name(name, lms_regex=lms_regex)
    if got is None or got.stamp is None:
        return None
    return got.stamp if got.stamp.tzinfo else got.stamp.replace(tzinfo=_zone(tz))


def _zip_time(infos: list[zipfile.ZipInfo], tz: str) -> dt.datetime | None:
    stamps = [dt.datetime(*i.date_time) for i in infos if not i.is_dir() and i.date_time[0] > 1980]
    return max(stamps).replace(tzinfo=_zone(tz)) if stamps else None


def _zip_file_time(path_or_bytes, tz: str) -> dt.datetime | None:
    try:
        src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
        with zipfile.ZipFile(src) as zf:
            return _zip_time(zf.infolist(), tz)
    except (zipfile.BadZipFile, OSError, ValueError):
        return None


@dataclass
class _Names:
    """How names are read: as intake reads them (the same ids, from the same patterns and class list)."""

    assignment: str = ""
    roster: object = None  # lmsnames.Roster or None
    lms_regex: str | None = None  # the instructor's own pattern, or None for the documented ones


def _lms_entry(name: str, names: _Names, tz: str, zipped=None) -> tuple[str, Stamp] | None:
    """(student id, stamp) for an LMS-named file; `zipped` is the file itself (path or bytes) when a .zip."""
    got = lmsnames.read_name(name, names.assignment, names.roster, names.lms_regex)
    if got is None or got.student_id is None:
        return None
    t = got.stamp
    if t is not None and t.tzinfo is None:
        t = t.replace(tzinfo=_zone(tz))
    stamp = Stamp(t, "file name" if t else "", got.late_mark,
                  "" if t else NO_STAMP.get(got.lms, "no LMS time in the name"))
    if t is None and zipped is not None:
        stamp.at = _zip_file_time(zipped, tz)
        stamp.source = STUDENT_ZIP if stamp.at else ""
    return got.student_id, stamp


def _from_class_zip(path: Path, names: _Names, tz: str) -> dict[str, Stamp]:
    found: dict[str, Stamp] = {}
    try:
        with zipfile.ZipFile(path) as zf:
            infos = [i for i in zf.infolist() if not i.is_dir() and "__MACOSX" not in i.filename]
            tops = {i.filename.split("/", 1)[0] for i in infos}
            strip = len(tops) == 1 and all("/" in i.filename for i in infos)  # one folder holding the class
            groups: dict[str, list[zipfile.ZipInfo]] = {}
            for i in infos:
                rel = i.filename.split("/", 1)[1] if strip else i.filename
                groups.setdefault(rel.split("/", 1)[0] + ("/" if "/" in rel else ""), []).append(i)
            for top, members in groups.items():
                if top.endswith("/"):  # a student's folder: its newest entry
                    t = _zip_time(members, tz)
                    got = lmsnames.read_folder(top[:-1], names.roster)
                    if got.student_id:
                        found[got.student_id] = Stamp(t, "zip entry date" if t else "", why="" if t else
                                                      "no date on the folder's entries")
                    continue
                info = members[0]
                nested = None
                if top.lower().endswith(".zip") and info.file_size <= MAX_NESTED_ZIP_BYTES:
                    nested = zf.read(info)
                got = _lms_entry(top, names, tz, nested)
                if got:
                    sid, stamp = got
                    if stamp.at is None:
                        stamp.at, stamp.source = _zip_time([info], tz), "zip entry date"
                    found[sid] = _later(found.get(sid), stamp)
    except (zipfile.BadZipFile, OSError) as e:
        raise LabkitError(f"cannot read {path}: {e}") from e
    return found


def _later(a: Stamp | None, b: Stamp) -> Stamp:
    """Two files of one student: the later time counts (the hand-in is complete only then)."""
    if a is None or (b.at and (a.at is None or b.at > a.at)):
        return Stamp(b.at, b.source, b.lms_late or (a.lms_late if a else False), b.why)
    a.lms_late = a.lms_late or b.lms_late
    return a


def read_times_csv(path: str | Path, tz: str = "UTC") -> dict[str, Stamp]:
    """student_id -> Stamp from a CSV with columns student_id and submitted_at."""
    rows = _csv_rows(path, ("student_id", "submitted_at"))
    return {intake.safe_id(r["student_id"]): Stamp(parse_time(r["submitted_at"], tz, f"{path}: submitted_at"), "csv")
            for r in rows if r["student_id"].strip() and r["submitted_at"].strip()}


def _csv_rows(path: str | Path, need: tuple[str, ...], any_of: tuple[str, ...] = ()) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise LabkitError(f"{p} does not exist")
    with p.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        cols = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in need if c not in cols]
        if missing or (any_of and not set(any_of) & set(cols)):
            want = ", ".join(need) + (f" and one of {', '.join(any_of)}" if any_of else "")
            raise LabkitError(f"{p}: expected columns {want}; found {', '.join(cols) or 'none'}")
        return [{k.strip(): (v or "") for k, v in r.items() if k} for r in reader]


def read_extensions(path: str | Path, due: dt.datetime, tz: str = "UTC") -> dict[str, dt.datetime]:
    """student_id -> due date from a CSV with student_id and either days (added to `due`) or due (ISO)."""
    out = {}
    for r in _csv_rows(path, ("student_id",), ("days", "due")):
        sid = intake.safe_id(r["student_id"])
        if r.get("due", "").strip():
            out[sid] = parse_time(r["due"], tz, f"{path}: due")
        elif r.get("days", "").strip():
            try:
                out[sid] = due + dt.timedelta(days=float(r["days"]))
            except ValueError as e:
                raise LabkitError(f"{path}: days {r['days']!r} for {sid} is not a number") from e
    return out


def submission_times(submissions: str | Path, *, lms_regex: str = intake.LMS_REGEX, tz: str = "UTC",
                     times_csv: str | None = None, roster=None, assignment: str = "") -> dict[str, Stamp]:
    """student id -> Stamp for every hand-in under `submissions` (folder or .zip) whose time can be known.

    Student ids are derived exactly as autograder.intake.submissions derives them (folder names, each LMS's pattern,
    `roster`: the class list, a path or an lmsnames.Roster; `assignment` reads names without one)."""
    src = Path(submissions)
    names = _Names(assignment, lmsnames.load_roster(roster), None if lms_regex == intake.LMS_REGEX else lms_regex)
    found: dict[str, Stamp] = {}
    if src.is_file() and src.suffix.lower() == ".zip":
        found = _from_class_zip(src, names, tz)
    elif src.is_dir():
        meta = lmsnames.gradescope_metadata(src)
        for entry in sorted(src.iterdir()):
            if entry.is_file():
                got = _lms_entry(entry.name, names, tz, entry if entry.suffix.lower() == ".zip" else None)
                if got:
                    found[got[0]] = _later(found.get(got[0]), got[1])
            elif meta and (gs := lmsnames.read_gradescope(entry.name, meta, names.roster)) and gs.student_id:
                t = gs.stamp if gs.stamp is None or gs.stamp.tzinfo else gs.stamp.replace(tzinfo=_zone(tz))
                found[gs.student_id] = Stamp(t, "Gradescope metadata" if t else "", why="" if t else NO_STAMP["gradescope"])
    if times_csv:
        found.update(read_times_csv(times_csv, tz))
    return found


def assess(policy: LatePolicy, student_id: str, stamp: Stamp | None, max_score: float) -> dict:
    """What the policy says about one hand-in: submitted_at, source, days_late, penalty (points), note."""
    due = policy.due_for(student_id)
    row = {"submitted_at": "", "time_source": "", "due": due.isoformat(), "days_late": 0, "late_penalty": 0.0,
           "late_note": ""}
    if stamp is None or stamp.at is None:
        why = f" ({stamp.why})" if stamp and stamp.why else ""
        row["late_note"] = (f"the LMS marked this hand-in late but its time is unknown{why}: give it in --submitted-csv"
                            if stamp and stamp.lms_late else f"no submission time found{why or ' (no LMS time stamp)'}: "
                                                             "not checked for lateness")
        return row
    over = (stamp.at - due).total_seconds()
    if stamp.source == STUDENT_ZIP and over <= policy.grace_s and not stamp.lms_late:
        row["late_note"] = (f"only its zip's entry dates ({stamp.at.isoformat()}, set by the student's machine) say "
                            "it was on time: not checked for lateness; give its time in --submitted-csv")
        return row
    if stamp.lms_late and stamp.source in ("zip entry date", STUDENT_ZIP) and over <= policy.grace_s:
        # the zip's entry dates come from the student's machine: they cannot overrule the LMS's own late mark
        row["late_note"] = (f"the LMS marked this hand-in late; only its zip's entry dates ({stamp.at.isoformat()}, "
                            "set by the student's machine) say it was on time: give its time in --submitted-csv")
        return row
    row["submitted_at"], row["time_source"] = stamp.at.isoformat(), stamp.source
    if over > policy.grace_s:
        days = math.ceil(over / 86400)
        pct = min(policy.per_day_pct * days, policy.cap_pct)
        row["days_late"], row["late_penalty"] = days, round(max_score * pct / 100, 4)
        row["late_note"] = (f"submitted {days} day(s) late ({stamp.at.isoformat()}, due {due.isoformat()}): "
                            f"-{pct:g}% = -{row['late_penalty']:g} points")
    elif over > 0:
        row["late_note"] = f"submitted within the grace period ({over / 60:.0f} min after the due date)"
    return row
