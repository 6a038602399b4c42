#!/usr/bin/env bash
# Build the zip to upload as a Gradescope "Programming Assignment" autograder, for lab1, lab2 or lab3:
#   autograder/deploy/gradescope/make_autograder.sh lab1      -> lab1_gradescope.zip
# It holds the committed repository (checks and references included: Gradescope never shows the autograder
# to students), setup.sh and run_autograder at its root, and LAB naming the lab.
set -euo pipefail
LAB=${1:?usage: make_autograder.sh lab1|lab2|lab3}
case "$LAB" in lab1|lab2|lab3) ;; *) echo "Gradescope has no GPU: labs 1-3 only" >&2; exit 2 ;; esac
# The course secret travels inside the zip (Gradescope never shows the autograder to students); without one the
# zip grades on the public open-kit default only if LABKIT_OPEN_KIT=1 says so (assignments/README.md).
if [ -z "${LABKIT_COURSE_SECRET:-}" ] && [ "${LABKIT_OPEN_KIT:-}" != "1" ]; then
    echo "set LABKIT_COURSE_SECRET (or LABKIT_OPEN_KIT=1 for a rehearsal) before building the autograder" >&2
    exit 2
fi
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$root" archive --format=tar HEAD | tar -x -C "$tmp"
cp "$root/autograder/deploy/gradescope/setup.sh" "$root/autograder/deploy/gradescope/run_autograder" "$tmp/"
chmod +x "$tmp/setup.sh" "$tmp/run_autograder"
echo "$LAB" > "$tmp/LAB"
if [ -n "${LABKIT_COURSE_SECRET:-}" ]; then
    (umask 077 && printf '%s' "$LABKIT_COURSE_SECRET" > "$tmp/COURSE_SECRET")
fi
(cd "$tmp" && zip -qr - .) > "${LAB}_gradescope.zip"
echo "wrote ${LAB}_gradescope.zip"
