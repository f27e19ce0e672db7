# Writes the installed form of the SDK's public headers: the same text, with the core headers'
# include paths moved under tessera/ ("core/mesh.h" -> "tessera/core/mesh.h"), so that an
# application needs only <prefix>/include on its include path.
#
#   cmake -DSOURCE_DIR=<repo> -DOUT_DIR=<dir> -DCLIENT_HEADERS="a.h;b.h" -DCORE_HEADERS="c.h" -P sdk_headers.cmake
cmake_minimum_required(VERSION 3.25)
function(rewrite from to)
  file(READ "${from}" text)
  string(REPLACE "#include \"core/" "#include \"tessera/core/" text "${text}")
  file(WRITE "${to}" "${text}")
endfunction()
file(REMOVE_RECURSE "${OUT_DIR}/tessera")  # a header dropped from the lists is not installed
foreach(header IN LISTS CLIENT_HEADERS)
  rewrite("${SOURCE_DIR}/client/include/tessera/${header}" "${OUT_DIR}/tessera/${header}")
endforeach()
foreach(header IN LISTS CORE_HEADERS)
  rewrite("${SOURCE_DIR}/core/${header}" "${OUT_DIR}/tessera/core/${header}")
endforeach()
