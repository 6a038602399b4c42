#!/bin/bash
# Queue a sliced grading run and its merge:  autograder/deploy/slurm_submit.sh ASSIGNMENT SUBMISSIONS [SHARDS]
# Extra grade options: GRADE_ARGS="--preset quick"; merge options (late policy): MERGE_ARGS="--due 2025-03-04T23:59".
set -euo pipefail
ASSIGNMENT=${1:?usage: slurm_submit.sh ASSIGNMENT SUBMISSIONS [SHARDS]}
SUBMISSIONS=${2:?usage: slurm_submit.sh ASSIGNMENT SUBMISSIONS [SHARDS]}
SHARDS=${3:-8}
here=$(dirname "$0")
mkdir -p grading-logs
export ASSIGNMENT SUBMISSIONS SHARDS
array=$(sbatch --parsable --array="0-$((SHARDS - 1))" --export=ALL "$here/slurm_grade.sbatch")
merge=$(sbatch --parsable --dependency="afterok:${array%%;*}" --export=ALL "$here/slurm_merge.sbatch")
echo "grading array $array ($SHARDS slices), merge $merge: results in ${OUT_ROOT:-grading/$ASSIGNMENT}/merged"
