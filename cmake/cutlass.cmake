# CUTLASS headers for the sm_90 forward product with row statistics (src/cuda/sm90/). Taken from
# LMLOSS_CUTLASS_INCLUDE when set, else from the nvidia-cutlass wheel on PyPI (its headers ship in
# cutlass_library/source/include), downloaded once into the build tree and checked against a
# pinned hash. Without them the library builds and runs as before, on the cuBLASLt path only.
#
# Sets lmloss_cutlass_include (empty when not found).

set(LMLOSS_CUTLASS_INCLUDE "" CACHE PATH "CUTLASS include directory (default: the PyPI wheel's)")
set(lmloss_cutlass_version 4.2.0.0)
set(lmloss_cutlass_sha256 f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6)
set(lmloss_cutlass_include "")

if(LMLOSS_CUTLASS_INCLUDE)
  set(lmloss_cutlass_include ${LMLOSS_CUTLASS_INCLUDE})
else()
  set(dir ${CMAKE_BINARY_DIR}/_deps/cutlass-${lmloss_cutlass_version})
  if(NOT EXISTS ${dir}/include/cutlass/cutlass.h)
    find_package(Python3 COMPONENTS Interpreter)
    if(Python3_Interpreter_FOUND)
      message(STATUS "lmloss: fetching CUTLASS ${lmloss_cutlass_version} headers from PyPI")
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -m pip download --quiet --no-deps --only-binary=:all:
                --disable-pip-version-check nvidia-cutlass==${lmloss_cutlass_version} -d ${dir}/wheel
        RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
      file(GLOB wheel ${dir}/wheel/nvidia_cutlass-${lmloss_cutlass_version}-*.whl)
      if(rc EQUAL 0 AND wheel)
        file(SHA256 ${wheel} hash)
        if(hash STREQUAL lmloss_cutlass_sha256)
          file(ARCHIVE_EXTRACT INPUT ${wheel} DESTINATION ${dir}/unpacked
               PATTERNS cutlass_library/source/include/*)
          file(RENAME ${dir}/unpacked/cutlass_library/source/include ${dir}/include)
          file(REMOVE_RECURSE ${dir}/unpacked ${dir}/wheel)
        else()
          message(WARNING "lmloss: the CUTLASS wheel's SHA-256 is ${hash}, not the pinned one")
        endif()
      else()
        message(WARNING "lmloss: could not download nvidia-cutlass from PyPI: ${err}")
      endif()
    endif()
  endif()
  if(EXISTS ${dir}/include/cutlass/cutlass.h)
    set(lmloss_cutlass_include ${dir}/include)
  endif()
endif()

if(lmloss_cutlass_include)
  message(STATUS "lmloss: CUTLASS headers in ${lmloss_cutlass_include}")
else()
  message(STATUS "lmloss: no CUTLASS headers; the sm_90 row statistics product is left out")
endif()
