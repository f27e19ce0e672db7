#!/bin/sh
# sanitize.no_reports (CMakeLists.txt, `ctest -L sanitize`): after the sanitizer suites, fails
# if any process wrote an ASan, UBSan or LeakSanitizer report, printing each under the name of
# the ctest test whose process (the test binary or a daemon it spawned) wrote it. The reports
# are files <dir>/<ctest name>.<pid> (each suite's log_path), so a daemon's report fails the run
# even where its test tolerated the daemon's death.
dir=$1
found=0
for f in "$dir"/*; do
  [ -f "$f" ] || continue
  found=$((found + 1))
  name=$(basename "$f")
  echo "==== sanitizer report of ${name%.*} (pid ${name##*.}) ===="
  cat "$f"
done
if [ "$found" -gt 0 ]; then
  echo "$found sanitizer report(s): each names its test above" >&2
  exit 1
fi
echo "no sanitizer reports in $dir"
