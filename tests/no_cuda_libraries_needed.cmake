# The shared library, and the command, must load where no CUDA library is installed (the CUDA
# backend then reports itself unavailable): none of the CUDA libraries may be among their NEEDED
# entries.
execute_process(COMMAND ${READELF} -d ${LIBRARY} OUTPUT_VARIABLE dynamic RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "readelf failed on ${LIBRARY}")
endif()
string(REGEX MATCHALL "NEEDED[^\n]*" needed "${dynamic}")
message(STATUS "${LIBRARY} needs: ${needed}")
foreach(entry IN LISTS needed)
  if(entry MATCHES "lib(cuda|cudart|cublas|cublasLt|nvrtc)\\.so")
    message(FATAL_ERROR "${LIBRARY} needs a CUDA library at load time: ${entry}")
  endif()
endforeach()
