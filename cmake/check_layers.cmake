# Run as: cmake -DFOLDER=runtime -DFORBIDDEN=tools -DLAYERS=core,...,runtime/data,...,runtime
#               -DROOT=... -DSTAMP=... -P check_layers.cmake
# Fails when a file of layer FOLDER includes a header of a forbidden layer.
# A path belongs to the longest layer that is a prefix of it: runtime/data/x.h
# to runtime/data, runtime/x.h to runtime. The files of FOLDER are those of
# its folder less those of wings below it that are layers of their own.
cmake_policy(SET CMP0057 NEW)  # if(IN_LIST)
string(REPLACE "," ";" forbidden "${FORBIDDEN}")
string(REPLACE "," ";" layers "${LAYERS}")

# The layer of a project-relative path ("" when none).
function(layer_of path out)
  set(best "")
  foreach(layer ${layers})
    string(LENGTH "${layer}" n)
    string(LENGTH "${best}" nb)
    if(path MATCHES "^${layer}/" AND n GREATER nb)
      set(best ${layer})
    endif()
  endforeach()
  set(${out} "${best}" PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE files ${ROOT}/${FOLDER}/*.h ${ROOT}/${FOLDER}/*.cc ${ROOT}/${FOLDER}/*.cu ${ROOT}/${FOLDER}/*.cuh)
set(errors "")
foreach(f ${files})
  file(RELATIVE_PATH rel ${ROOT} ${f})
  layer_of(${rel} own)
  if(NOT own STREQUAL FOLDER)
    continue()  # a wing with its own check
  endif()
  file(STRINGS ${f} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]")
  foreach(line ${lines})
    if(NOT line MATCHES "#[ \t]*include[ \t]*[\"<]([^\">]+)[\">]")
      continue()
    endif()
    layer_of(${CMAKE_MATCH_1} included)
    if(included AND included IN_LIST forbidden)
      string(APPEND errors "  ${rel}: ${line}  (layer ${included})\n")
    endif()
  endforeach()
endforeach()
if(errors)
  message(FATAL_ERROR "layer violation: ${FOLDER}/ may not include these project layers "
          "(the stack is core <- kernels, comm <- models <- runtime/data, runtime/config <- runtime/step, "
          "runtime/observe, runtime/resilience <- runtime/checkpoint <- runtime <- analysis <- tools):\n${errors}")
endif()
file(WRITE ${STAMP} "ok\n")
