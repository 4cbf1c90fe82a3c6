#!/usr/bin/env bash
# Is the working tree faster than a commit's? Runs one benchmark command against both trees, alternating, on one
# machine: the commit's ("base") and the working tree ("work"). A GPU's bandwidth drifts between runs and machines
# by more than most kernel changes are worth, so two trees compare only within one run.
#
#   bash benchmarks/ab_trees.sh prepare REV            extract REV's pegainfer/ and benchmarks/ into build/ab/base
#                                                      (where git is; then carry build/ab to the GPU machine)
#   bash benchmarks/ab_trees.sh run ROUNDS -- CMD...   run CMD in each tree, ROUNDS times, base first then work
#
# CMD runs with the tree as its working directory and PYTHONPATH starting with it (after any entries already in
# PYTHONPATH that hold no pegainfer, e.g. a folder of extra wheels), so `python -m pegainfer ...` and
# `python benchmarks/X.py ...` import that tree's code; without this, a benchmark script run from the base tree
# would import the working tree's pegainfer from PYTHONPATH (graph_timing.py appends its own checkout after
# PYTHONPATH). Logs go to $OUT (default ./gpu_out) as ab_TREE_ROUND.log; `{out}` in CMD is replaced by
# $OUT/ab_TREE_ROUND (e.g. `--json {out}.json`). Numba's cache keys compiled kernels by source path: the two trees
# never share an entry.
#
#   bash benchmarks/ab_trees.sh prepare main
#   bash benchmarks/ab_trees.sh run 2 -- python3 benchmarks/bench_gated_delta.py --decode-batch 1,64 --json {out}.json
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BASE="${AB_BASE:-$ROOT/build/ab/base}"   # AB_BASE: another place for it
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

case "${1:-}" in
  prepare)
    [ $# -eq 2 ] || usage
    rev=$(git -C "$ROOT" rev-parse --short "$2") || exit 2
    rm -rf "$BASE" && mkdir -p "$BASE"
    git -C "$ROOT" archive "$rev" pegainfer benchmarks | tar -x -C "$BASE" || exit 1
    echo "$rev" > "$BASE/REV"
    echo "$BASE: $rev ($(git -C "$ROOT" log -1 --format=%s "$rev" | cut -c1-80))"
    ;;
  run)
    [ $# -ge 4 ] && [ "$3" = "--" ] || usage
    rounds=$2; shift 3
    [ -f "$BASE/REV" ] || { echo "error: no base tree: run 'bash benchmarks/ab_trees.sh prepare REV' first" >&2; exit 2; }
    OUT="${OUT:-$ROOT/gpu_out}"; mkdir -p "$OUT"
    extra=""   # PYTHONPATH entries without a pegainfer of their own stay in front (wheels shadowing the image's)
    IFS=: read -ra entries <<< "${PYTHONPATH:-}"
    for e in "${entries[@]}"; do
      [ -n "$e" ] && [ ! -d "$e/pegainfer" ] && extra="$extra:$e"
    done
    echo "base $(cat "$BASE/REV"), work $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(
      [ -n "$(git -C "$ROOT" status --porcelain -- pegainfer benchmarks 2>/dev/null)" ] && echo ' + changes')"
    status=0
    for ((r = 1; r <= rounds; r++)); do
      for tree in base work; do
        dir=$([ "$tree" = base ] && echo "$BASE" || echo "$ROOT")
        out="$OUT/ab_${tree}_$r"
        cmd=("${@//\{out\}/$out}")
        echo "=== $tree, round $r: ${cmd[*]}"
        (cd "$dir" && PYTHONPATH="$dir$extra" "${cmd[@]}") > "$out.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || { echo "--- exit status $rc"; status=1; }
        grep -v "Warning\|warn(" "$out.log" | tail -n "${AB_TAIL:-12}"
      done
    done
    exit $status
    ;;
  *) usage ;;
esac
