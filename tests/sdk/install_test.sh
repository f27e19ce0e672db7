#!/bin/sh
# The SDK as an application outside the tree gets it: install the build into a temporary
# prefix, then
#   1. every installed header compiles on its own with only <prefix>/include on the path, and
#      none includes generated proto or gRPC headers, nor xtensor's outside the opt-in
#      tessera/xtensor.h and tessera/core/xtensor_interop.h;
#   2. examples/app configures with find_package(tessera), builds, and runs on Client::local(8),
#      and so does its xtensor variant through tessera::xtensor;
#   3. the same program builds with pkg-config's flags and runs;
#   4. the library's SONAME carries the major version (MAJOR.MINOR before 1.0).
#
#   sh tests/sdk/install_test.sh SOURCE_DIR BUILD_DIR
set -eu
for tool in cmake g++ pkg-config readelf; do
  command -v "$tool" >/dev/null || { echo "FAIL: $tool is not installed (./dev install brings it)"; exit 1; }
done
src=$1
build=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/tessera-sdk.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log" 2>&1 || { cat "$work/install.log"; echo "FAIL: install"; exit 1; }
library=$(find "$prefix" -name 'libtessera.so' | head -n 1)
[ -n "$library" ] || { echo "FAIL: no libtessera.so installed"; exit 1; }
libdir=$(dirname "$library")
echo "installed into $prefix (libraries in ${libdir#"$prefix"/})"

for header in $(cd "$prefix/include" && find tessera -name '*.h' | sort); do
  echo "#include <$header>" > "$work/one_header.cc"
  if ! g++ -std=c++17 -fsyntax-only -Wall -Wextra -Werror -I"$prefix/include" "$work/one_header.cc"; then
    echo "FAIL: the installed header $header does not compile on its own"
    exit 1
  fi
done
if grep -rnE '#include [<"](grpc|grpcpp/|google/protobuf/|proto/|xtensor/)' "$prefix/include" |
   grep -vE 'tessera/(core/xtensor_interop|xtensor)\.h:'; then
  echo "FAIL: installed headers include implementation headers (above)"
  exit 1
fi
echo "ok: $(cd "$prefix/include" && find tessera -name '*.h' | wc -l) installed headers compile on their own"

generator=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$build/CMakeCache.txt")
cmake -S "$src/examples/app" -B "$work/app" -G "${generator:-Unix Makefiles}" -DCMAKE_PREFIX_PATH="$prefix" \
  >"$work/app-configure.log" 2>&1 || { cat "$work/app-configure.log"; echo "FAIL: configuring examples/app"; exit 1; }
cmake --build "$work/app" >"$work/app-build.log" || { cat "$work/app-build.log"; exit 1; }
"$work/app/app" > "$work/app.out" || { rc=$?; cat "$work/app.out"; echo "FAIL: examples/app exited with $rc"; exit 1; }
cat "$work/app.out"
grep -q '^app: ok$' "$work/app.out"
echo "ok: examples/app with find_package(tessera)"
[ -x "$work/app/app_xtensor" ] || { echo "FAIL: no app_xtensor (tessera::xtensor missing with xtensor installed)"; exit 1; }
"$work/app/app_xtensor" > "$work/app-xtensor.out" ||
  { rc=$?; cat "$work/app-xtensor.out"; echo "FAIL: app_xtensor exited with $rc"; exit 1; }
grep -q '^app: ok$' "$work/app-xtensor.out"
echo "ok: examples/app's app_xtensor with tessera::xtensor"

export PKG_CONFIG_PATH="$libdir/pkgconfig"
# shellcheck disable=SC2046  # pkg-config's flags are words
g++ -O1 -o "$work/app-pc" "$src/examples/app/main.cc" $(pkg-config --cflags --libs tessera)
LD_LIBRARY_PATH="$libdir" "$work/app-pc" > "$work/app-pc.out"
grep -q '^app: ok$' "$work/app-pc.out"
version=$(pkg-config --modversion tessera)
echo "ok: the same program with pkg-config --cflags --libs tessera ($version)"
grep -q "^tessera $version (built against $version), protocol [0-9]" "$work/app.out" ||
  { echo "FAIL: the app does not report version $version"; exit 1; }

soname=$(readelf -d "$libdir/libtessera.so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
major=$(echo "$version" | cut -d. -f1)
minor=$(echo "$version" | cut -d. -f2)
if [ "$major" = 0 ]; then want="libtessera.so.0.$minor"; else want="libtessera.so.$major"; fi
[ "$soname" = "$want" ] || { echo "FAIL: SONAME is '$soname', expected '$want'"; exit 1; }
echo "ok: SONAME $soname"
