# shellcheck shell=bash
# Sourced by the GPU benchmark scripts: sets `commit`, the source version every JSON line's label
# records: $BENCH_COMMIT if set, else the checkout's commit, with "+changes" when the tracked files
# differ from it. A device machine's copy of the working tree can carry an older .git than its
# files (round 14 found a label naming the session's first commit on code three commits later),
# so a label without "+changes" is the commit only where git saw no difference.
commit=${BENCH_COMMIT:-$(git -C "$(dirname "${BASH_SOURCE[0]}")/.." describe --always \
  --abbrev=7 --dirty=+changes 2>/dev/null || echo unknown)}
