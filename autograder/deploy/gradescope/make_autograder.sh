#!/usr/bin/env bash
# Build the zip to upload as a Gradescope "Programming Assignment" autograder, for lab1, lab2 or lab3:
#   autograder/deploy/gradescope/make_autograder.sh lab1      -> lab1_gradescope.zip
# It holds the committed repository (checks and references included: Gradescope never shows the autograder
# to students), setup.sh and run_autograder at its root, and LAB naming the lab.
set -euo pipefail
LAB=${1:?usage: make_autograder.sh lab1|lab2|lab3}
case "$LAB" in lab1|lab2|lab3) ;; *) echo "Gradescope has no GPU: labs 1-3 only" >&2; exit 2 ;; esac
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$root" archive --format=tar HEAD | tar -x -C "$tmp"
cp "$root/autograder/deploy/gradescope/setup.sh" "$root/autograder/deploy/gradescope/run_autograder" "$tmp/"
chmod +x "$tmp/setup.sh" "$tmp/run_autograder"
echo "$LAB" > "$tmp/LAB"
(cd "$tmp" && zip -qr - .) > "${LAB}_gradescope.zip"
echo "wrote ${LAB}_gradescope.zip"
