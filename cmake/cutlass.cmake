# CUTLASS headers for the sm_90 forward product with row statistics (src/cuda/sm90/). Taken from
# LMLOSS_CUTLASS_INCLUDE when set, else from the nvidia-cutlass wheel on PyPI (its headers ship in
# cutlass_library/source/include), downloaded once into the build tree and checked against a
# pinned hash. Without them the library builds and runs as before, on the cuBLASLt path only.
#
# The wheel comes by CMake's own download from its PyPI address, so that a build without pip (pip's
# isolated build environment for `pip install .`) gets it too; where that fails, pip downloads it,
# through whatever index or mirror pip is configured for.
#
# Sets lmloss_cutlass_include (empty when not found).

set(LMLOSS_CUTLASS_INCLUDE "" CACHE PATH "CUTLASS include directory (default: the PyPI wheel's)")
set(lmloss_cutlass_version 4.2.0.0)
set(lmloss_cutlass_sha256 f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6)
set(lmloss_cutlass_url "https://files.pythonhosted.org/packages/21/6b/e86fc2fd536dd4b8bd2209aa31d7002610c501b0802337787eac9c9b328c/nvidia_cutlass-${lmloss_cutlass_version}-py3-none-any.whl")
set(lmloss_cutlass_include "")

if(LMLOSS_CUTLASS_INCLUDE)
  set(lmloss_cutlass_include ${LMLOSS_CUTLASS_INCLUDE})
else()
  set(dir ${CMAKE_BINARY_DIR}/_deps/cutlass-${lmloss_cutlass_version})
  if(NOT EXISTS ${dir}/include/cutlass/cutlass.h)
    message(STATUS "lmloss: fetching CUTLASS ${lmloss_cutlass_version} headers from PyPI")
    set(wheel ${dir}/wheel/nvidia_cutlass-${lmloss_cutlass_version}-py3-none-any.whl)
    file(DOWNLOAD ${lmloss_cutlass_url} ${wheel} TLS_VERIFY ON STATUS status)  # hash checked below
    list(GET status 0 rc)
    if(NOT rc EQUAL 0)
      list(GET status 1 why)
      file(REMOVE ${wheel})
      find_package(Python3 COMPONENTS Interpreter)
      if(Python3_Interpreter_FOUND)
        execute_process(
          COMMAND ${Python3_EXECUTABLE} -m pip download --quiet --no-deps --only-binary=:all:
                  --disable-pip-version-check nvidia-cutlass==${lmloss_cutlass_version} -d ${dir}/wheel
          RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
        if(NOT rc EQUAL 0)
          message(WARNING "lmloss: could not download nvidia-cutlass from PyPI: ${why}; pip: ${err}")
        endif()
      else()
        message(WARNING "lmloss: could not download nvidia-cutlass from PyPI: ${why}")
      endif()
    endif()
    if(EXISTS ${wheel})
      file(SHA256 ${wheel} hash)
      if(hash STREQUAL lmloss_cutlass_sha256)
        file(ARCHIVE_EXTRACT INPUT ${wheel} DESTINATION ${dir}/unpacked
             PATTERNS cutlass_library/source/include/*)
        file(RENAME ${dir}/unpacked/cutlass_library/source/include ${dir}/include)
      else()
        message(WARNING "lmloss: the CUTLASS wheel's SHA-256 is ${hash}, not the pinned one")
      endif()
    endif()
    file(REMOVE_RECURSE ${dir}/unpacked ${dir}/wheel)
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
